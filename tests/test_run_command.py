"""`trio-gym run FILE.jsonl --url URL`, as a user runs it against a live host."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import trio

from tests.helpers import CountingRunner, running_host

HANG_GUARD_S = 60


def write_examples(path: Path, examples: list[Any]) -> Path:
    path.write_text("".join(json.dumps(example) + "\n" for example in examples))
    return path


async def trio_gym_run(*args: str) -> trio.CompletedProcess[bytes]:
    with trio.fail_after(HANG_GUARD_S):
        return await trio.run_process(
            [sys.executable, "-m", "trio_gym", "run", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


async def test_run_writes_results_in_input_order_with_progress(tmp_path: Path) -> None:
    examples = write_examples(
        tmp_path / "in.jsonl",
        [
            {"seed": i, "meetings": 3, "think_s": 0.05 * (i % 3), "_ng_task_index": i}
            for i in range(10)
        ],
    )
    async with running_host(runner=CountingRunner(), heartbeat_interval_s=0.05) as (host, port):
        done = await trio_gym_run(
            str(examples),
            "--url",
            f"http://127.0.0.1:{port}",
            "--out",
            str(tmp_path / "out.jsonl"),
            "--chunk-size",
            "3",
        )
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(line)["_ng_task_index"] for line in lines] == list(range(10))
    assert b"10/10 examples done" in done.stderr
    assert b"chunk 4/4 finished" in done.stderr


async def test_run_prints_results_to_stdout_without_out(tmp_path: Path) -> None:
    examples = write_examples(tmp_path / "in.jsonl", [{"seed": 4}, {"seed": 5}])
    async with running_host(runner=CountingRunner()) as (host, port):
        done = await trio_gym_run(str(examples), "--url", f"http://127.0.0.1:{port}", "--http10")
    assert done.returncode == 0
    assert [json.loads(line)["seed"] for line in done.stdout.splitlines()] == [4, 5]


async def test_a_failure_exits_1_with_its_cause_and_writes_nothing(tmp_path: Path) -> None:
    examples = write_examples(tmp_path / "in.jsonl", [{"seed": 1, "think_s": 5}])
    out = tmp_path / "out.jsonl"
    async with running_host(runner=CountingRunner()) as (host, port):
        late = await trio_gym_run(
            str(examples),
            "--url",
            f"http://127.0.0.1:{port}",
            "--deadline",
            "0.2",
            "--out",
            str(out),
        )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    unreachable = await trio_gym_run(
        str(examples), "--url", f"http://127.0.0.1:{closed_port}", "--max-attempts", "1"
    )
    assert late.returncode == 1 and b"failed (sandbox)" in late.stderr
    assert b"deadline_exceeded" in late.stderr
    assert not out.exists()
    assert unreachable.returncode == 1 and b"failed (proxy)" in unreachable.stderr
    assert b"could not connect" in unreachable.stderr


async def test_a_bad_examples_file_exits_2_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "in.jsonl"
    bad.write_text('{"seed": 1}\n\n[2]\n')
    done = await trio_gym_run(str(bad), "--url", "http://127.0.0.1:9")
    assert done.returncode == 2
    assert f"{bad}:3: each line must be a JSON object".encode() in done.stderr
