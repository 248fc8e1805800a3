"""The README's commands and configuration examples are the real ones (docs that cannot rot)."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest
import trio
import yaml

from tests.helpers import CountingRunner, running_host
from tests.processes import serve_process
from trio_gym.config import load_caller_config, load_serve_config
from trio_gym.runners import ExampleContext, Runner

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_the_first_two_commands_set_up_and_run_the_demo_then_the_tests() -> None:
    first, second = code_blocks("bash")[:2]
    assert first.strip().endswith("trio-gym demo")
    assert second.strip().endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    assert second.strip() in ci.splitlines()  # CI runs exactly the README's test command


def test_the_serve_config_example_is_a_valid_serve_config(tmp_path: Path) -> None:
    block = next(b for b in code_blocks("yaml") if b.startswith("# serve.yaml"))
    file = tmp_path / "serve.yaml"
    file.write_text(block)
    config = load_serve_config(file=file, environ={})
    assert config.environment_offline is True


def test_the_caller_config_example_is_a_valid_caller_config() -> None:
    block = next(b for b in code_blocks("yaml") if b.startswith("# caller config"))
    caller = load_caller_config(yaml.safe_load(block), source="README")
    assert caller.environment_offline is True
    assert caller.bootstrap_environment()["NMP_ENVIRONMENT_OFFLINE"] == "1"


async def test_the_trainer_program_runs_against_a_live_host(tmp_path: Path) -> None:
    program = next(b for b in code_blocks("python") if "RolloutClient(" in b)
    async with running_host(runner=CountingRunner()) as (host, port):
        script = tmp_path / "trainer.py"
        script.write_text(program.replace("127.0.0.1:8080", f"127.0.0.1:{port}"))
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, str(script)], capture_stdout=True, capture_stderr=True
            )
    assert done.stdout.startswith(b"mean reward ")


async def test_the_runner_example_is_a_runner_that_runs() -> None:
    block = next(b for b in code_blocks("python") if "class MyRunner" in b)
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), namespace)
    runner = namespace["factory"]()  # type: ignore[operator]
    assert isinstance(runner, Runner)
    await runner.start()
    result = await runner.run_example({"prompt": "hi"}, ExampleContext("b", 0))
    assert result == {"reward": 1.0}
    try:
        runner.check_example({})
    except ValueError as exc:
        assert "prompt" in str(exc)
    else:
        raise AssertionError("check_example accepted an example without a prompt")


async def test_the_row_stream_program_runs_against_a_live_host(tmp_path: Path) -> None:
    program = next(b for b in code_blocks("python") if "client.stream(" in b)
    async with running_host(runner=CountingRunner()) as (host, port):
        script = tmp_path / "rows.py"
        script.write_text(program.replace("127.0.0.1:8080", f"127.0.0.1:{port}"))
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, str(script)], capture_stdout=True, capture_stderr=True
            )
    assert b"StreamSummary(completed=4, failed=0) []" in done.stdout


def test_the_checkpoint_example_compiles() -> None:
    block = next(b for b in code_blocks("python") if "HostControl(" in b)
    compile(block, "README.md", "exec")


async def test_the_checkpointing_program_checkpoints_then_restores_against_a_live_host(
    tmp_path: Path,
) -> None:
    program = next(b for b in code_blocks("python") if "CheckpointCoordinator(" in b)
    env = {"NMP_CONTROL_TOKEN": "change-me", "NMP_HEARTBEAT_INTERVAL_S": "0.2"}
    async with serve_process(env=env) as (_, _, port):
        script = tmp_path / "trainer.py"
        script.write_text(program.replace("127.0.0.1:8080", f"127.0.0.1:{port}"))
        runs = []
        for _ in range(2):
            with trio.fail_after(60):
                done = await trio.run_process(
                    [sys.executable, str(script)], capture_stdout=True, cwd=tmp_path
                )
            runs.append(dict(line.split(" ", 1) for line in done.stdout.decode().splitlines()))
    first, second = runs
    exported = int(first["exported"])
    assert exported > 0 and first["consumed"] == "8"  # the first run finished every episode
    restored = json.loads(second["restored"])  # the second took the first's checkpoint back
    assert len(restored) == exported and all(key.endswith("-a1") for key in restored)
    assert second["consumed"] == str(exported)  # and ran each parked episode once more


async def run_program(
    script: Path, program: str, *, timeout_s: float
) -> trio.CompletedProcess[bytes]:
    """Run a README program from the checkout's top, importing this checkout's trio_gym."""
    await trio.Path(script).write_text(program)
    with trio.fail_after(timeout_s):
        return await trio.run_process(
            [sys.executable, str(script)],
            capture_stdout=True,
            capture_stderr=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )


async def test_the_pool_program_launches_local_hosts_and_answers_every_example(
    tmp_path: Path,
) -> None:
    program = next(b for b in code_blocks("python") if "HostPool(" in b)
    done = await run_program(tmp_path / "pool.py", program, timeout_s=120)
    assert done.stdout == b"64 of 64 examples answered\n", done.stderr


@pytest.mark.ray
async def test_the_ray_actor_program_runs_on_a_fresh_cluster(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray: pip install 'trio-gym[ray]' (.ci/run installs it)")
    program = next(b for b in code_blocks("python") if "remote_actor()" in b)
    # Ray's socket paths must stay short: its temp dir cannot be this test's deep tmp_path.
    temporary = tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp")
    cluster = (
        'ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", '
        f'_temp_dir="{temporary.name}", log_to_driver=False)'
    )
    with temporary:
        program = program.replace("ray.init()", cluster) + "\nray.shutdown()\n"
        done = await run_program(tmp_path / "actor.py", program, timeout_s=180)
    assert done.stdout.startswith(b"16 of 16 rows, mean reward "), done.stderr[-2000:]
