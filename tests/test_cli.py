"""The command line, as a user runs it: real subprocesses, real signals, real sockets."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from typing import Any

import pytest
import trio

from tests.helpers import read_reply, request_bytes, tcp_exchange
from tests.processes import LogReader, processes_with, serve_process

HANG_GUARD_S = 60


async def test_serve_honours_nmp_variables_and_answers_a_batch() -> None:
    env = {"NMP_JOB_ID": "job-42", "NMP_WORK_PATH": "/tmp/work", "NMP_HEARTBEAT_INTERVAL_S": "0.05"}
    async with serve_process(env=env) as (process, logs, port):
        request = {"examples": [{"seed": 3, "meetings": 3, "think_s": 0.1}]}
        reply = await tcp_exchange(port, request_bytes(request))
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(HANG_GUARD_S):
            assert await process.wait() == 0
    document = reply.json()
    assert document["job_id"] == "job-42" and document["work_path"] == "/tmp/work"
    assert document["results"][0]["seed"] == 3
    assert reply.heartbeat_times  # NMP_HEARTBEAT_INTERVAL_S took effect


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_answers_in_flight_batches_shutting_down_and_exits(signum: int) -> None:
    async with serve_process("--heartbeat-interval", "0.1") as (process, logs, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            request = {"examples": [{"seed": i, "meetings": 3, "think_s": 60} for i in range(3)]}
            await stream.send_all(request_bytes(request))
            with trio.fail_after(HANG_GUARD_S):
                await logs.wait_for("batch_running")
                process.send_signal(signum)
                reply = await read_reply(stream)
        with trio.fail_after(HANG_GUARD_S):
            assert await process.wait() == 0
            await logs.wait_for("stopped")
    assert reply.status == 200 and reply.complete
    assert reply.json()["error"]["code"] == "shutting_down"
    names = [event["event"] for event in logs.events]
    assert names.index("shutdown_requested") < names.index("batch_failing")


async def test_a_config_error_exits_2_naming_the_problem(tmp_path: Any) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("port: 0\nheartbeat: 5\n")
    result = await trio.run_process(
        [sys.executable, "-m", "trio_gym", "serve", "--config", str(config)],
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 2
    assert b"heartbeat: unknown key 'heartbeat'" in result.stderr


async def test_demo_runs_a_batch_and_prints_a_summary() -> None:
    command = shutil.which("trio-gym")
    argv = [command] if command else [sys.executable, "-m", "trio_gym"]
    with trio.fail_after(HANG_GUARD_S):
        result = await trio.run_process(
            [*argv, "demo", "--examples", "8"], capture_stdout=True, capture_stderr=True
        )
    out = result.stdout.decode()
    assert "Summary" in out and "episodes        8" in out
    progress = result.stderr.decode()
    assert "chunk 2/2" in progress and "heartbeat" in progress


async def test_a_signal_during_a_hung_runner_import_still_exits() -> None:
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "trio_gym",
            "serve",
            "--port",
            "0",
            "--runner",
            "tests.hanging_import_runner:factory",
        ],
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    logs = LogReader(process.stderr)
    try:
        with trio.fail_after(HANG_GUARD_S):
            await logs.wait_for("stage_started")
            await logs.wait_for("stage_started")  # installing, then starting_runner
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_port_in_use_exits_2_naming_it() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with trio.fail_after(HANG_GUARD_S):
            result = await trio.run_process(
                [sys.executable, "-m", "trio_gym", "serve", "--port", str(port)],
                capture_stderr=True,
                check=False,
            )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}".encode() in result.stderr
    assert b"Traceback" not in result.stderr


async def test_install_of_an_explicitly_named_missing_package_fails() -> None:
    with trio.fail_after(HANG_GUARD_S):
        result = await trio.run_process(
            [sys.executable, "-m", "trio_gym", "install", "--environment-path", "/no/such/env"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 1
    assert b"/no/such/env is not a directory" in result.stderr


async def test_the_fleet_demo_loses_a_host_mid_run_and_consumes_every_episode_once() -> None:
    """``trio-gym demo --fleet``: four host processes, a checkpoint, a host SIGKILLed and
    replaced; the summary's counts prove exactly-once, and no host process is left."""
    token = uuid.uuid4().hex
    done = await trio.run_process(
        [sys.executable, "-m", "trio_gym", "demo", "--fleet", "--examples", "16"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**os.environ, "TRIO_GYM_FLEET_DEMO_TEST": token},
    )
    left = processes_with("TRIO_GYM_FLEET_DEMO_TEST", token)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, out + err
    assert "every episode exactly once: yes" in out
    assert "consumed twice              0" in out and "never consumed              0" in out
    assert "side effects as one run     16 of 16" in out
    restored = int(out.split("continued from checkpoint")[1].split()[0])
    assert restored >= 1  # the killed host's parked episodes went on on its replacement
    assert "SIGKILL local-" in err and "took its place" in err
    assert left == []
