"""`trio-gym run FILE.jsonl --url URL` (or several, or `--launch local:N`), as a user runs it."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import pytest
import trio

from tests.helpers import CountingRunner, running_host
from tests.processes import kill_all, processes_with, run_trio_gym, write_examples

HANG_GUARD_S = 60
POOL_TEST = "TRIO_GYM_POOL_TEST"


async def trio_gym_run(*args: str) -> trio.CompletedProcess[bytes]:
    return await run_trio_gym("run", *args)


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


async def test_a_failed_chunk_exits_1_with_its_cause_and_a_failure_record_per_example(
    tmp_path: Path,
) -> None:
    examples = write_examples(
        tmp_path / "in.jsonl", [{"seed": 1, "think_s": 5}, {"seed": 2, "_ng_task_index": 7}]
    )
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
    assert out.read_text() == ""  # no example has a result
    failures = list(map(json.loads, (tmp_path / "out_failures.jsonl").read_text().splitlines()))
    assert [f["_ng_failure_class"] for f in failures] == ["host_request_failed"] * 2
    assert [(f["_ng_task_index"], f["_ng_rollout_index"]) for f in failures] == [(0, 0), (7, 0)]
    assert all("deadline_exceeded" in f["_ng_failure_message"] for f in failures)
    assert failures[0]["_trio_gym_failure_origin"] == "sandbox"
    assert b"2 of 2 examples failed; their failure records are in" in late.stderr
    assert unreachable.returncode == 1 and b"failed (proxy)" in unreachable.stderr
    assert b"could not connect" in unreachable.stderr


async def test_a_failed_example_costs_its_chunk_mates_nothing_and_lands_beside_the_results(
    tmp_path: Path,
) -> None:
    rows = [{"seed": i, "meetings": 2} for i in range(6)]
    rows[2] = {"seed": 2, "meetings": 2, "fail_at_step": 1, "_ng_task_index": 42}
    examples = write_examples(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    stale = tmp_path / "out_failures.jsonl"
    async with running_host(runner=CountingRunner()) as (host, port):
        done = await trio_gym_run(
            str(examples), "--url", f"http://127.0.0.1:{port}", "--out", str(out)
        )
        written = [json.loads(line)["seed"] for line in out.read_text().splitlines()]
        failed = [json.loads(line) for line in stale.read_text().splitlines()]
        stale.write_text("an earlier run's\n")
        clean = await trio_gym_run(
            str(write_examples(tmp_path / "good.jsonl", [rows[0]])),
            *("--url", f"http://127.0.0.1:{port}", "--out", str(out)),
        )
    assert done.returncode == 1, done.stderr
    assert b"1 of 6 examples failed" in done.stderr and b"5 results in" in done.stderr
    # One chunk of six: the five others were not cancelled with it, and keep their order.
    assert written == [0, 1, 3, 4, 5]
    assert [f["_ng_task_index"] for f in failed] == [42]  # the row's own, carried
    assert host.services.stats.examples_cancelled == 0
    assert clean.returncode == 0 and not stale.exists()  # no stale sidecar beside clean results


async def test_the_failure_record_of_a_failed_example_is_the_hosts(tmp_path: Path) -> None:
    rows = [{"seed": i, "meetings": 2} for i in range(4)]
    rows[1] = {"seed": 1, "meetings": 2, "fail_at_step": 1}
    examples = write_examples(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    async with running_host(runner=CountingRunner()) as (host, port):
        done = await trio_gym_run(
            str(examples), "--url", f"http://127.0.0.1:{port}", "--out", str(out)
        )
    assert done.returncode == 1, done.stderr
    assert [r["seed"] for r in map(json.loads, out.read_text().splitlines())] == [0, 2, 3]
    (failure,) = map(json.loads, (tmp_path / "out_failures.jsonl").read_text().splitlines())
    assert failure["_ng_failure_class"] == "runner_error"
    assert failure["_ng_failure_type"] == "EnvironmentFault"
    # Named by its place in the file, as Gym's collection numbers a row without its keys.
    assert (failure["_ng_task_index"], failure["_ng_rollout_index"]) == (1, 0)


async def test_a_bad_examples_file_exits_2_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "in.jsonl"
    bad.write_text('{"seed": 1}\n\n[2]\n')
    done = await trio_gym_run(str(bad), "--url", "http://127.0.0.1:9")
    assert done.returncode == 2
    assert f"{bad}:3: each line must be a JSON object".encode() in done.stderr


async def test_run_spreads_the_file_over_every_url_given(tmp_path: Path) -> None:
    examples = write_examples(tmp_path / "in.jsonl", [{"seed": i} for i in range(12)])
    first, second = CountingRunner(), CountingRunner()
    async with (
        running_host(runner=first) as (_, one),
        running_host(runner=second) as (_, two),
    ):
        done = await trio_gym_run(
            str(examples),
            *("--url", f"http://127.0.0.1:{one}", "--url", f"http://127.0.0.1:{two}"),
            *("--chunk-size", "2", "--max-in-flight", "1"),
        )
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["seed"] for line in done.stdout.splitlines()] == list(range(12))
    assert len(first.completed) + len(second.completed) == 12
    assert first.completed and second.completed


def host_config(tmp_path: Path, runner: str, token: str) -> Path:
    """A caller config for launched hosts: ``runner``, recording to ``tmp_path``."""
    record = tmp_path / "record.jsonl"
    record.touch()
    config = tmp_path / "hosts.yaml"
    host_env = {"NMP_RUNNER": runner, "TRIO_GYM_TEST_RECORD": str(record), POOL_TEST: token}
    config.write_text(json.dumps({"host_env": host_env, "work_path": str(tmp_path / "work")}))
    return config


async def test_run_launches_local_hosts_spreads_over_them_and_stops_them(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    examples = write_examples(tmp_path / "in.jsonl", [{"id": i, "sleep_s": 0.1} for i in range(12)])
    config = host_config(tmp_path, "tests.user_runner:recording", token)
    try:
        done = await trio_gym_run(
            str(examples),
            *("--launch", "local:3", "--host-config", str(config)),
            *("--chunk-size", "2", "--max-in-flight", "1"),
        )
        assert done.returncode == 0, done.stderr
        results = [json.loads(line) for line in done.stdout.splitlines()]
        assert [result["id"] for result in results] == list(range(12))
        assert len({result["pid"] for result in results}) == 3
        assert processes_with(POOL_TEST, token) == []
    finally:
        kill_all(POOL_TEST, token)


async def test_run_says_which_launched_host_failed_to_start_and_why(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    examples = write_examples(tmp_path / "in.jsonl", [{"id": 0}])
    config = host_config(tmp_path, "tests.user_runner:failing_start", token)
    try:
        done = await trio_gym_run(
            str(examples), "--launch", "local:2", "--host-config", str(config)
        )
        assert done.returncode == 1
        assert b"trio-gym run: could not launch the hosts: host local-" in done.stderr
        assert b"the model endpoint refused every connection" in done.stderr
        assert processes_with(POOL_TEST, token) == []
    finally:
        kill_all(POOL_TEST, token)


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        ((), b"give the hosts: --url URL (repeatable) or --launch KIND:N"),
        (("--launch", "docker:2"), b"--launch 'docker:2': no provider 'docker'; choose ['local']"),
        (("--launch", "local"), b"--launch 'local': expected KIND:N, e.g. local:4"),
        (("--launch", "local:0"), b"--launch 'local:0': launch at least one host"),
        (("--launch", "local:1", "--url", "http://127.0.0.1:9"), b"give --url or --launch, not"),
        (("--url", "ftp://h"), b"'ftp://h': only http:// URLs are supported"),
        (
            ("--launch", "local:1", "--identity-file", "IDENTITY_FILE"),
            b"--identity-file is for --url",
        ),
        (("--url", "http://h:1", "--identity-file", "/nonexistent"), b"cannot read the identity"),
    ],
)
async def test_a_choice_of_hosts_that_cannot_work_exits_2_saying_why(
    tmp_path: Path, hosts: tuple[str, ...], expected: bytes
) -> None:
    examples = write_examples(tmp_path / "in.jsonl", [{"id": 0}])
    (tmp_path / "identity").write_text("an-identity\n")
    hosts = tuple(str(tmp_path / "identity") if arg == "IDENTITY_FILE" else arg for arg in hosts)
    done = await trio_gym_run(str(examples), *hosts)
    assert done.returncode == 2
    assert expected in done.stderr


async def test_a_host_that_never_answers_is_given_up_on_at_the_flags_timeouts(
    tmp_path: Path,
) -> None:
    """A stalled host (it takes the connection, then says nothing): --head-timeout bounds the
    wait for its head; a host that answers its head and then goes silent, --idle-timeout."""
    examples = write_examples(tmp_path / "in.jsonl", [{"seed": 1}])
    async with trio.open_nursery() as nursery:
        silent = trio.socket.socket()
        await silent.bind(("127.0.0.1", 0))
        silent.listen()
        held: list[trio.socket.SocketType] = []

        async def accept_and_say_nothing() -> None:
            while True:
                connection, _ = await silent.accept()
                held.append(connection)  # open, read by no one: a SIGSTOPped host

        nursery.start_soon(accept_and_say_nothing)
        port = silent.getsockname()[1]
        stalled = await trio_gym_run(
            str(examples), "--url", f"http://127.0.0.1:{port}", "--max-attempts", "1",
            "--head-timeout", "0.5", "--request-deadline", "30", "--out", str(tmp_path / "a.jsonl"),
        )  # fmt: skip
        nursery.cancel_scope.cancel()
    for connection in held:
        connection.close()
    silent.close()
    async with running_host(runner=CountingRunner()) as (host, port):
        quiet = await trio_gym_run(
            str(write_examples(tmp_path / "long.jsonl", [{"seed": 1, "think_s": 30}])),
            "--url", f"http://127.0.0.1:{port}", "--idle-timeout", "0.5",
            "--out", str(tmp_path / "b.jsonl"),
        )  # fmt: skip
    assert stalled.returncode == 1 and b"failed (proxy)" in stalled.stderr
    assert b"within 0.5 s of the request's end (head_timeout_s)" in stalled.stderr
    assert quiet.returncode == 1  # heartbeats every 15 s: 0.5 s of silence ends it
    assert b"0.5" in quiet.stderr


@pytest.mark.parametrize("urls", [1, 2], ids=["one-url", "two-urls"])
async def test_run_presents_the_identity_in_its_file_to_hosts_launched_with_one(
    tmp_path: Path, urls: int
) -> None:
    """Such a host serves only callers that send it; the file may end in CRLF (a Windows
    editor's), which is not part of the identity."""
    identity = uuid.uuid4().hex
    (tmp_path / "identity").write_bytes(identity.encode() + b"\r\n")
    examples = write_examples(tmp_path / "in.jsonl", [{"seed": i} for i in range(4)])
    async with running_host(runner=CountingRunner(), host_identity=identity) as (host, port):
        given = [arg for _ in range(urls) for arg in ("--url", f"http://127.0.0.1:{port}")]
        done = await trio_gym_run(
            str(examples), *given, "--identity-file", str(tmp_path / "identity")
        )
        refused = await trio_gym_run(str(examples), *given, "--out", str(tmp_path / "r.jsonl"))
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["seed"] for line in done.stdout.splitlines()] == [0, 1, 2, 3]
    assert refused.returncode == 1 and b"identity_required" in refused.stderr
    assert identity.encode() not in done.stderr + refused.stderr
