"""The host against real NeMo Gym 0.7.0: Gym started by the host itself, as a sandbox runs it.

The host is launched as the upstream orchestrator launches its host (``NMP_*`` variables, the
environment package, ``NMP_GYM_GLOBAL_CONFIG``, no runner named); it starts Gym's launcher, Ray
(on 127.0.0.1), a head server and five servers from the package and the operator's config; the
model is ``tests/stub_model.py``. Needs the environment ``scripts/gym_env.sh`` builds (Python
3.13 and about 1.5 GB); without it every test here is skipped, saying so. ``.ci/run`` builds it.

Real clock throughout: these are other processes. One deployment is shared by the tests that
leave it standing; the tests that kill something start their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from tests.helpers import read_reply, request_bytes, tcp_exchange
from tests.real_gym import (
    REPO,
    Launched,
    environment_of,
    gym_global_config,
    gym_site,
    launched_host,
    prebuilt_venvs,
    real_gym_python,
    row,
    tagged_processes,
    taskset_row,
    weather_package,
)

pytestmark = pytest.mark.real_gym

START_TIMEOUT_S = 240  # Ray and five servers on two shared cores; 20-30 s when idle
HANG_GUARD_S = 120
ROWS = [("Accept", "application/x-ndjson")]


@attrs.frozen
class Stub:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=10) as reply:
            stats: dict[str, int] = json.load(reply)
            return stats


@attrs.frozen
class RealGym:
    python: str
    site: Path
    stub: Stub


@attrs.frozen
class Deployment:
    launched: Launched
    port: int
    tag: str


@pytest.fixture(scope="module")
def real_gym(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealGym]:
    python = real_gym_python()
    if python is None:
        pytest.skip(
            "real NeMo Gym is not built here: run scripts/gym_env.sh (it needs a Python 3.13; "
            ".ci/run does it)"
        )
    port_file = tmp_path_factory.mktemp("stub") / "port"
    stub = subprocess.Popen([sys.executable, "-m", "tests.stub_model", str(port_file)], cwd=REPO)
    try:
        deadline = time.monotonic() + 30  # clock-ok: a test fixture waiting for a subprocess
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and stub.poll() is None, (
                "the stub did not start"
            )  # clock-ok
            time.sleep(0.05)  # clock-ok
        yield RealGym(python, gym_site(python), Stub(stub, int(port_file.read_text())))
    finally:
        stub.kill()
        stub.wait()


def wait_until_up(launched: Launched) -> Deployment:
    """Poll the launched host's /health until ready; fail with its answer and log otherwise."""
    deadline = time.monotonic() + START_TIMEOUT_S  # clock-ok
    answer: Any = None
    while time.monotonic() < deadline:  # clock-ok
        listening, starting = launched.event("listening"), launched.event("gym_starting")
        if launched.process.poll() is not None:
            pytest.fail(f"the host exited: {launched.log.read_text()[-3000:]}")
        if listening and starting:
            try:
                url = f"http://127.0.0.1:{listening['port']}/health"
                with urllib.request.urlopen(url, timeout=10) as reply:
                    answer = json.load(reply)
                    return Deployment(launched, listening["port"], starting["deployment"])
            except urllib.error.HTTPError as exc:
                answer = json.load(exc)
                if answer["status"] == "failed":
                    pytest.fail(f"the host failed to start: {answer}")
        time.sleep(0.25)  # clock-ok
    pytest.fail(f"not up within {START_TIMEOUT_S} s; last /health: {answer}")


@contextmanager
def deployment(tmp_path: Path, gym: RealGym, **host_env: str) -> Iterator[Launched]:
    """A host of its own, launched as a sandbox launches it (not yet waited for)."""
    package = weather_package(tmp_path / "environment", gym.site)
    leave_out = (
        tuple(host_env.pop("LEAVE_OUT_VENV", "").split(",")) if "LEAVE_OUT_VENV" in host_env else ()
    )
    venvs = prebuilt_venvs(tmp_path / "venvs", gym.python, leave_out=leave_out)
    config = gym_global_config(gym.stub.url, venvs)
    with launched_host(tmp_path, gym.python, package, config, **host_env) as launched:
        yield launched


@pytest.fixture(scope="module")
def shared(real_gym: RealGym, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One deployment for the tests that leave it standing."""
    with deployment(tmp_path_factory.mktemp("shared"), real_gym) as launched:
        yield wait_until_up(launched)
        launched.process.send_signal(signal.SIGTERM)
        launched.process.wait(timeout=HANG_GUARD_S)


async def stub_stats(gym: RealGym) -> dict[str, int]:
    return await trio.to_thread.run_sync(gym.stub.stats)


async def until(predicate: Any, what: str) -> None:
    with trio.fail_after(HANG_GUARD_S):
        while not await predicate():  # noqa: ASYNC110 - other processes' state, no event to wait on
            await trio.sleep(0.05)


def lines_of(reply: Any) -> dict[Any, dict[str, Any]]:
    """NDJSON lines by index (the done line under "done")."""
    parsed = [json.loads(line) for line in reply.body.split(b"\n") if line.strip()]
    return {line.get("index", "done"): line for line in parsed}


async def health(port: int) -> Any:
    return await tcp_exchange(port, request_bytes(method="GET", target="/health"))


async def test_rows_run_to_rewards_with_the_records_gyms_collection_writes(
    shared: Deployment,
) -> None:
    rows = [
        row("weather_agent", "what is the weather in sf?", 0),
        row("weather_agent", "weather [no-tool]", 1),
        row("weather_session_agent", "what is the weather in sf?", 2),
        taskset_row("what is the weather in sf?", 3),
    ]
    with trio.fail_after(HANG_GUARD_S):
        document = await tcp_exchange(shared.port, request_bytes({"examples": rows}))
        stream = await tcp_exchange(shared.port, request_bytes({"examples": rows}, headers=ROWS))
    results = document.json()["results"]
    assert [r["reward"] for r in results] == [1.0, 0.0, 1.0, 1.0]  # the verifier's, per row
    assert [r["_ng_task_index"] for r in results] == [0, 1, 2, 3]
    servers = ["weather_env", "weather_env", "weather_turn_env", "weather_turn_env"]
    assert [r["_ng_environment_server"] for r in results] == servers
    kinds = ["legacy_agent", "legacy_agent", "single_agent_turn_legacy", "single_agent_turn_legacy"]
    assert [r["_ng_result_type"] for r in results] == kinds
    assert results[0]["agent_ref"] == {"name": "weather_agent"}
    assert not any("_ng_rollout_id" in r or "_ng_attempt_index" in r for r in results)
    assert document.json()["job_id"] == "real-gym"
    lines = lines_of(stream)
    assert lines["done"] == {"done": True, "completed": 4, "failed": 0}
    assert [lines[i]["result"]["reward"] for i in range(4)] == [1.0, 0.0, 1.0, 1.0]


async def test_an_agents_500_and_a_failure_record_fail_their_rows_readably(
    shared: Deployment,
) -> None:
    rows = [
        row("weather_agent", "weather [fail]", 10),  # the legacy relay: the agent answers 500
        row("weather_session_agent", "weather [fail]", 11),  # a 200 with _ng_failure_class
        row("weather_agent", "what is the weather in sf?", 12),
    ]
    with trio.fail_after(HANG_GUARD_S):
        reply = await tcp_exchange(shared.port, request_bytes({"examples": rows}, headers=ROWS))
    lines = lines_of(reply)
    agent_error = lines[0]["error"]["message"]
    assert "environment server 'weather_env'" in agent_error and "answered HTTP 500" in agent_error
    assert 'inner server: {"error": {"message": "the stub model refuses"}}' in agent_error
    assert "\\\\" not in agent_error.split("Traceback")[0]  # read once: no escapes left over
    failure = lines[1]["error"]["message"]
    assert "_ng_failure_class=environment_server_failed (after 3 attempt(s))" in failure
    assert lines[2]["result"]["reward"] == 1.0
    assert lines["done"] == {"done": True, "completed": 1, "failed": 2}


async def test_a_caller_that_leaves_and_a_deadline_both_reach_the_model_call(
    shared: Deployment, real_gym: RealGym
) -> None:
    before = await stub_stats(real_gym)
    hanging = row("weather_agent", "weather [hang]", 20)
    async with await trio.open_tcp_stream("127.0.0.1", shared.port) as stream:
        await stream.send_all(request_bytes({"examples": [hanging]}, headers=ROWS))
        await until(lambda: _running(real_gym, before["running"] + 1), "the model call")
    # The caller has left.
    await until(lambda: _disconnects(real_gym, before["disconnects"] + 1), "the cut")
    with trio.fail_after(HANG_GUARD_S):
        reply = await tcp_exchange(
            shared.port, request_bytes({"examples": [hanging], "deadline_s": 2})
        )
    assert reply.json()["error"]["code"] == "deadline_exceeded"
    await until(lambda: _disconnects(real_gym, before["disconnects"] + 2), "the cut")
    assert (await stub_stats(real_gym))["running"] == before["running"]


async def _running(gym: RealGym, count: int) -> bool:
    return (await stub_stats(gym))["running"] == count


async def _disconnects(gym: RealGym, count: int) -> bool:
    return (await stub_stats(gym))["disconnects"] >= count


async def test_gym_killed_mid_batch_fails_its_rows_and_the_host_says_why(
    real_gym: RealGym, tmp_path: Path
) -> None:
    with deployment(tmp_path, real_gym) as launched:
        up = await trio.to_thread.run_sync(wait_until_up, launched)
        before = await stub_stats(real_gym)
        hanging = [row("weather_agent", "weather [hang]", task) for task in (30, 31)]
        async with await trio.open_tcp_stream("127.0.0.1", up.port) as stream:
            await stream.send_all(request_bytes({"examples": hanging}, headers=ROWS))
            await until(lambda: _running(real_gym, before["running"] + 2), "the model calls")
            for pid in tagged_processes(up.tag):  # all of Gym; the host's guard stays
                if b"processes/guard.py" not in _cmdline(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            with trio.fail_after(HANG_GUARD_S):
                reply = await read_reply(stream)
                answer = await health(up.port)
                while answer.json()["status"] != "failed":
                    await trio.sleep(0.05)  # the guard reports the leader's end as it sees it
                    answer = await health(up.port)
    lines = lines_of(reply)
    assert lines["done"] == {"done": True, "completed": 0, "failed": 2}
    assert all("error" in lines[index] for index in (0, 1))
    assert answer.status == 503 and answer.json()["stage"] == "gym"
    assert "the Gym deployment exited with status 137" in answer.json()["error"]["message"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
async def test_no_gym_process_outlives_the_host(
    real_gym: RealGym, tmp_path: Path, signum: int
) -> None:
    with deployment(tmp_path, real_gym) as launched:
        up = await trio.to_thread.run_sync(wait_until_up, launched)
        processes = tagged_processes(up.tag)
        launcher = next(
            pid
            for pid in processes
            if b"env\0start" in _cmdline(pid) and b"processes/guard.py" not in _cmdline(pid)
        )
        group = os.getpgid(launcher)
        assert launcher == group and len(processes) >= 9  # launcher, Ray's, six servers
        servers = [pid for pid in processes if _cmdline(pid).split(b"\0")[-2:-1] == [b"app.py"]]
        servers = [pid for pid in servers if _cmdline(pid).split(b"\0")[0].endswith(b"python")]
        assert len(servers) == 6  # two agents, two environment servers, tools, model
        environ = environment_of(servers[0])  # what the environment's code sees
        assert environ["NMP_BROKER_URL"] == "http://127.0.0.1:9/broker"
        assert environ["NMP_DATASET_PATH"].endswith("dataset")
        assert "NMP_CONTROL_TOKEN" not in environ
        launched.process.send_signal(signum)
        with trio.fail_after(HANG_GUARD_S):
            await trio.to_thread.run_sync(launched.process.wait)
        if signum == signal.SIGTERM:
            assert tagged_processes(up.tag) == []  # the host exits only once Gym is gone
        else:
            await until(lambda: _none_left(up.tag), "every Gym process gone")
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)  # the whole process group is gone too


async def _none_left(tag: str) -> bool:
    return not tagged_processes(tag)


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


async def test_the_callers_offline_choice_reaches_gyms_per_server_builds(
    real_gym: RealGym, tmp_path: Path
) -> None:
    # No prebuilt venv for the resources server: Gym builds one with uv, and the caller said
    # offline, so uv may not reach an index (and the venv cannot be built here without one).
    host_env = {
        "NMP_ENVIRONMENT_OFFLINE": "1",
        "LEAVE_OUT_VENV": "resources_servers/example_single_tool_call",
        "UV_CACHE_DIR": str(tmp_path / "empty-uv-cache"),  # nothing to find offline
    }
    with deployment(tmp_path, real_gym, **host_env) as launched:
        with trio.fail_after(START_TIMEOUT_S):
            while launched.event("stage_failed") is None:  # noqa: ASYNC110 - another process
                await trio.sleep(0.25)
        failed = launched.event("stage_failed")
        build = [
            e["line"]
            for e in launched.events()
            if e["event"] == "process_output" and e["line"].startswith("(weather_tools)")
        ]
    assert failed is not None and failed["stage"] == "starting_gym"
    assert "Process `weather_tools` finished unexpectedly" in failed["error"]
    assert any("network was disabled" in line or "offline" in line for line in build), build
