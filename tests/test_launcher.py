"""scripts/gym_host.sh, run as a sandbox image runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.helpers import request_bytes, tcp_exchange
from tests.processes import LogReader

LAUNCHER = Path(__file__).resolve().parent.parent / "scripts" / "gym_host.sh"
HANG_GUARD_S = 60

PACKAGE_RUNNER = """
from trio_gym.runners import ExampleRunner


class PackagedRunner(ExampleRunner):
    async def run_example(self, example, context):
        return {**(await super().run_example(example, context)), "runner": "packaged"}


def factory():
    return PackagedRunner()
"""


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], b"no runtime given"),
        (["/no/such/python"], b"is not an executable file"),
        (["/bin/true"], b"cannot import trio_gym"),
    ],
    ids=["missing", "nonexistent", "not-a-trio-gym-python"],
)
def test_the_launcher_refuses_to_start_without_a_usable_runtime(
    argv: list[str], fragment: bytes
) -> None:
    result = subprocess.run(["bash", str(LAUNCHER), *argv], capture_output=True, check=False)
    assert result.returncode == 2
    assert fragment in result.stderr


async def test_the_launcher_starts_the_host_with_the_package_on_pythonpath(tmp_path: Path) -> None:
    package = tmp_path / "env"
    package.mkdir()
    (package / "packaged_runner.py").write_text(PACKAGE_RUNNER)
    environ = {**os.environ, "NMP_ENVIRONMENT_PATH": str(package), "NMP_JOB_ID": "launched"}
    environ.pop("PYTHONPATH", None)
    process = await trio.lowlevel.open_process(
        [
            "bash",
            str(LAUNCHER),
            sys.executable,
            "--port",
            "0",
            "--runner",
            "packaged_runner:factory",
        ],
        stderr=subprocess.PIPE,
        env=environ,
    )
    assert process.stderr is not None
    logs = LogReader(process.stderr)
    try:
        with trio.fail_after(HANG_GUARD_S):
            listening = await logs.wait_for("listening")
            port = listening["port"]
            await logs.wait_for("ready")
            reply = await tcp_exchange(port, request_bytes({"examples": [{"seed": 2}]}))
            process.send_signal(signal.SIGTERM)  # exec'd: the signal reaches the host itself
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert listening["host"] == "0.0.0.0"  # a sandbox's published port reaches it
    document = reply.json()
    assert document["job_id"] == "launched"
    assert document["results"][0]["runner"] == "packaged"
