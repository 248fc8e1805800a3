"""The installer stage with the real uv binary, a wheelhouse built here, and no network.

"An index configured but unreachable" is an http:// address on loopback where nothing listens:
exactly the sandbox's situation, found in milliseconds instead of after a DNS timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.helpers import request_bytes, tcp_exchange
from tests.packages import native_package, wheels_package
from tests.processes import LogReader
from trio_gym.config import ServeConfig
from trio_gym.install import InstallError, install_environment
from trio_gym.install.stage import SITE_PACKAGES, find_uv

HANG_GUARD_S = 120


@pytest.fixture
def unreachable_index() -> str:
    """An index URL on loopback with nothing listening: every request is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/simple"


@pytest.fixture
def base_environ(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A clean environment for uv: its own cache, no Python downloads, no inherited UV_*."""
    environ = {key: value for key, value in os.environ.items() if not key.startswith("UV_")}
    environ.pop("PYTHONPATH", None)
    environ.update(
        UV_CACHE_DIR=str(tmp_path / "uv-cache"),
        UV_PYTHON_DOWNLOADS="never",
        UV_HTTP_RETRIES="0",
        UV_NO_CONFIG="1",
    )
    yield environ


def config_for(package: Path, work: Path, **overrides: Any) -> ServeConfig:
    return ServeConfig(environment_path=str(package), work_path=str(work), **overrides)


def child_import(environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import tiny_env_dep; print(tiny_env_dep.VERSION)"],
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )


def child_uv_install(
    environ: dict[str, str], venv: Path, index: str
) -> subprocess.CompletedProcess[str]:
    """What Gym's per-server venv builds do: a fresh venv, then uv pip install by name."""
    uv = find_uv(environ)
    subprocess.run(
        [uv, "venv", "--python", sys.executable, str(venv)],
        env=environ,
        check=True,
        capture_output=True,
    )
    return subprocess.run(
        [uv, "pip", "install", "--python", str(venv / "bin" / "python"), "tiny-env-dep"],
        env={**environ, "UV_INDEX_URL": index},
        capture_output=True,
        text=True,
        check=False,
    )


async def test_wheels_install_and_are_found_by_children_and_by_uv_offline(
    tmp_path: Path, base_environ: dict[str, str], unreachable_index: str
) -> None:
    package = wheels_package(tmp_path / "pkg")
    environ = dict(base_environ)
    sys_path = ["/usr/lib/python-placeholder"]
    config = config_for(package, tmp_path / "work", environment_offline=True)

    installed = await install_environment(config, environ=environ, sys_path=sys_path)

    assert installed is not None and installed.name == "tiny-env"
    target = tmp_path / "work" / SITE_PACKAGES
    assert (target / "tiny_env_dep" / "__init__.py").is_file()
    assert sys_path[0] == str(target)  # the host process imports from here first
    assert environ["PYTHONPATH"] == str(target)
    assert environ["UV_FIND_LINKS"] == str(package / "wheels")
    assert environ["UV_OFFLINE"] == "1"
    # (b) a child process imports it through PYTHONPATH
    child = child_import(environ)
    assert child.returncode == 0 and child.stdout.strip() == "1.0.0", child.stderr
    # (c) a child uv resolves it from the wheelhouse although an index is configured
    resolved = child_uv_install(environ, tmp_path / "venv", unreachable_index)
    assert resolved.returncode == 0, resolved.stderr
    assert "tiny-env-dep==1.0.0" in resolved.stderr


async def test_without_offline_an_unreachable_index_breaks_resolution(
    tmp_path: Path, base_environ: dict[str, str], unreachable_index: str
) -> None:
    """The seed's liability: UV_FIND_LINKS alone does not keep uv off a configured index."""
    package = wheels_package(tmp_path / "pkg")
    environ = dict(base_environ)
    config = config_for(package, tmp_path / "work", environment_offline=False)
    await install_environment(config, environ=environ, sys_path=[])
    assert "UV_OFFLINE" not in environ  # index fallback kept
    assert environ["UV_FIND_LINKS"] == str(package / "wheels")
    resolved = child_uv_install(environ, tmp_path / "venv", unreachable_index)
    assert resolved.returncode != 0
    assert "Connection refused" in resolved.stderr


@pytest.mark.parametrize(
    ("operator", "offline", "resolves"),
    [("0", True, False), ("1", False, True)],
    ids=["operator-0-beats-offline-config", "operator-1-beats-online-config"],
)
async def test_the_operators_uv_offline_wins(
    tmp_path: Path,
    base_environ: dict[str, str],
    unreachable_index: str,
    operator: str,
    offline: bool,
    resolves: bool,
) -> None:
    package = wheels_package(tmp_path / "pkg")
    environ = {**base_environ, "UV_OFFLINE": operator}
    config = config_for(package, tmp_path / "work", environment_offline=offline)
    await install_environment(config, environ=environ, sys_path=[])
    assert environ["UV_OFFLINE"] == operator
    resolved = child_uv_install(environ, tmp_path / "venv", unreachable_index)
    assert (resolved.returncode == 0) is resolves, resolved.stderr


async def test_native_packages_install_nothing_but_the_offline_choice_applies(
    tmp_path: Path, base_environ: dict[str, str]
) -> None:
    environ = dict(base_environ)
    config = config_for(
        native_package(tmp_path / "pkg"), tmp_path / "work", environment_offline=True
    )
    package = await install_environment(config, environ=environ, sys_path=[])
    assert package is not None and package.format == "native-v1"
    assert not (tmp_path / "work").exists()
    assert "UV_FIND_LINKS" not in environ and environ["UV_OFFLINE"] == "1"


async def test_existing_paths_are_kept_behind_the_install(
    tmp_path: Path, base_environ: dict[str, str]
) -> None:
    environ = {**base_environ, "PYTHONPATH": "/opt/a", "UV_FIND_LINKS": "/opt/wheels"}
    config = config_for(wheels_package(tmp_path / "pkg"), tmp_path / "work")
    await install_environment(config, environ=environ, sys_path=[])
    target = tmp_path / "work" / SITE_PACKAGES
    assert environ["PYTHONPATH"] == f"{target}{os.pathsep}/opt/a"
    assert environ["UV_FIND_LINKS"] == f"{tmp_path / 'pkg' / 'wheels'},/opt/wheels"


async def test_no_package_is_a_no_op_unless_required(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    assert await install_environment(ServeConfig(), environ=environ, sys_path=[]) is None
    assert (
        await install_environment(
            ServeConfig(environment_path=str(tmp_path)), environ=environ, sys_path=[]
        )
        is None
    )
    assert environ == {}
    with pytest.raises(InstallError, match="NMP_ENVIRONMENT_PATH"):
        await install_environment(
            ServeConfig(environment_package_required=True), environ=environ, sys_path=[]
        )
    with pytest.raises(InstallError, match=r"nemo-environment\.yaml is missing"):
        await install_environment(
            ServeConfig(environment_path=str(tmp_path), environment_package_required=True),
            environ=environ,
            sys_path=[],
        )


async def test_an_invalid_package_fails_naming_the_problem(tmp_path: Path) -> None:
    package = wheels_package(tmp_path / "pkg")
    (package / "wheels" / "notes.txt").write_text("x")
    with pytest.raises(InstallError, match=r"wheels/notes\.txt: not a wheel"):
        await install_environment(config_for(package, tmp_path / "work"), environ={}, sys_path=[])


def fake_uv(directory: Path, script: str) -> Path:
    """A stand-in ``uv`` on PATH (for what the real one cannot be made to do on demand)."""
    directory.mkdir(parents=True, exist_ok=True)
    uv = directory / "uv"
    uv.write_text("#!/usr/bin/env bash\n" + script)
    uv.chmod(0o755)
    return directory


async def test_a_failing_uv_is_reported_with_its_output(
    tmp_path: Path, base_environ: dict[str, str]
) -> None:
    bin_dir = fake_uv(tmp_path / "bin", 'echo "resolution failed: no wheel for tiny" >&2\nexit 3\n')
    environ = {**base_environ, "PATH": f"{bin_dir}:{base_environ['PATH']}"}
    config = config_for(wheels_package(tmp_path / "pkg"), tmp_path / "work")
    with pytest.raises(InstallError, match=r"(?s)exited with status 3:.*no wheel for tiny"):
        await install_environment(config, environ=environ, sys_path=[])
    assert "UV_FIND_LINKS" not in environ  # nothing pointed at a failed install


async def test_a_slow_uv_is_stopped_at_the_install_timeout(
    tmp_path: Path, base_environ: dict[str, str]
) -> None:
    pid_file = tmp_path / "uv.pid"
    bin_dir = fake_uv(tmp_path / "bin", f"echo $$ > {pid_file}\nexec sleep 600\n")
    environ = {**base_environ, "PATH": f"{bin_dir}:{base_environ['PATH']}"}
    config = config_for(wheels_package(tmp_path / "pkg"), tmp_path / "work", install_timeout_s=1)
    with (
        trio.fail_after(HANG_GUARD_S),
        pytest.raises(InstallError, match="did not finish within 1 s"),
    ):
        await install_environment(config, environ=environ, sys_path=[])
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the child was killed and reaped, not left running


async def test_cancelling_the_stage_kills_uv(tmp_path: Path, base_environ: dict[str, str]) -> None:
    pid_file = tmp_path / "uv.pid"
    bin_dir = fake_uv(tmp_path / "bin", f"echo $$ > {pid_file}\nexec sleep 600\n")
    environ = {**base_environ, "PATH": f"{bin_dir}:{base_environ['PATH']}"}
    config = config_for(wheels_package(tmp_path / "pkg"), tmp_path / "work")
    with trio.move_on_after(1) as scope:
        await install_environment(config, environ=environ, sys_path=[])
    assert scope.cancelled_caught
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


# --- the stage inside a real host process -------------------------------------------------


async def start_host(environ: dict[str, str], *args: str) -> tuple[trio.Process, LogReader, int]:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_gym", "serve", "--port", "0", *args],
        stderr=subprocess.PIPE,
        env=environ,
    )
    assert process.stderr is not None
    logs = LogReader(process.stderr)
    port = (await logs.wait_for("listening"))["port"]
    return process, logs, port


async def stop_host(process: trio.Process) -> None:
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(HANG_GUARD_S):
        assert await process.wait() == 0


async def health(port: int) -> dict[str, Any]:
    reply = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
    return {"status_code": reply.status, **reply.json()}


async def test_the_host_process_imports_the_installed_wheel(
    tmp_path: Path, base_environ: dict[str, str]
) -> None:
    """(a): the runner itself comes from the wheel the stage installed."""
    environ = {
        **base_environ,
        "NMP_ENVIRONMENT_PATH": str(wheels_package(tmp_path / "pkg", version="1.2.3")),
        "NMP_WORK_PATH": str(tmp_path / "work"),
        "NMP_ENVIRONMENT_OFFLINE": "true",
    }
    with trio.fail_after(HANG_GUARD_S):
        process, logs, port = await start_host(environ, "--runner", "tiny_env_dep.runner:factory")
        try:
            await logs.wait_for("ready")
            reply = await tcp_exchange(port, request_bytes({"examples": [{"seed": 5}]}))
        finally:
            await stop_host(process)
    assert reply.json()["results"][0]["from_wheel"] == "1.2.3"
    prepared = next(e for e in logs.events if e["event"] == "environment_prepared")
    assert prepared["uv_offline"] == "1" and prepared["uv_offline_source"] == "config"
    assert any(e["event"] == "process_output" and e["process"] == "uv" for e in logs.events)


async def test_health_across_the_stage_starting_then_ready(
    tmp_path: Path, base_environ: dict[str, str]
) -> None:
    gate = tmp_path / "gate"
    bin_dir = fake_uv(
        tmp_path / "bin", f"until [ -e {gate} ]; do sleep 0.05; done\necho installed\n"
    )
    environ = {
        **base_environ,
        "PATH": f"{bin_dir}:{base_environ['PATH']}",
        "NMP_ENVIRONMENT_PATH": str(wheels_package(tmp_path / "pkg")),
        "NMP_WORK_PATH": str(tmp_path / "work"),
    }
    with trio.fail_after(HANG_GUARD_S):
        process, logs, port = await start_host(environ)
        try:
            await logs.wait_for("process_started")
            during = await health(port)
            post = await tcp_exchange(port, request_bytes({"examples": []}))
            gate.touch()
            await logs.wait_for("ready")
            after = await health(port)
        finally:
            await stop_host(process)
    assert during == {"status_code": 503, "status": "starting", "stage": "installing"}
    assert post.status == 503 and post.json()["error"]["code"] == "not_ready"
    assert after == {"status_code": 200, "status": "ready"}


async def test_health_reports_a_failed_install_and_the_process_stays_up(
    tmp_path: Path, base_environ: dict[str, str]
) -> None:
    bin_dir = fake_uv(tmp_path / "bin", 'echo "no matching distribution" >&2\nexit 1\n')
    environ = {
        **base_environ,
        "PATH": f"{bin_dir}:{base_environ['PATH']}",
        "NMP_ENVIRONMENT_PATH": str(wheels_package(tmp_path / "pkg")),
        "NMP_WORK_PATH": str(tmp_path / "work"),
    }
    with trio.fail_after(HANG_GUARD_S):
        process, logs, port = await start_host(environ)
        try:
            await logs.wait_for("stage_failed")
            failed = await health(port)
            again = await health(port)
        finally:
            await stop_host(process)
    assert failed["status_code"] == 503 and failed["status"] == "failed"
    assert failed["stage"] == "installing"
    assert failed["error"]["code"] == "bootstrap_failed"
    assert "no matching distribution" in failed["error"]["message"]
    assert again == failed


async def test_a_required_package_that_is_missing_fails_the_start(
    tmp_path: Path, base_environ: dict[str, str]
) -> None:
    environ = {
        **base_environ,
        "NMP_ENVIRONMENT_PATH": str(tmp_path / "not-copied"),
        "NMP_ENVIRONMENT_PACKAGE_REQUIRED": "1",
    }
    with trio.fail_after(HANG_GUARD_S):
        process, logs, port = await start_host(environ)
        try:
            await logs.wait_for("stage_failed")
            failed = await health(port)
        finally:
            await stop_host(process)
    assert failed["status"] == "failed" and "not-copied" in failed["error"]["message"]


async def test_install_command_runs_only_the_stage(
    tmp_path: Path, base_environ: dict[str, str]
) -> None:
    package = wheels_package(tmp_path / "pkg")
    argv = [sys.executable, "-m", "trio_gym", "install", "--environment-path", str(package)]
    with trio.fail_after(HANG_GUARD_S):
        done = await trio.run_process(
            [*argv, "--work-path", str(tmp_path / "work")],
            env=base_environ,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        missing_work = await trio.run_process(
            argv, env=base_environ, capture_stdout=True, capture_stderr=True, check=False
        )
    assert done.returncode == 0, done.stderr
    assert b"tiny-env (wheels-v1)" in done.stdout
    assert (tmp_path / "work" / SITE_PACKAGES / "tiny_env_dep").is_dir()
    assert missing_work.returncode == 1 and b"NMP_WORK_PATH" in missing_work.stderr
