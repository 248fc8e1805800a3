"""The host against real NeMo Gym 0.7.0: Gym started by the host itself, as a sandbox runs it.

The host is launched as the upstream orchestrator launches its host (``NMP_*`` variables, the
environment package, ``NMP_GYM_GLOBAL_CONFIG``, no runner named); it starts Gym's launcher, Ray
(on 127.0.0.1), a head server and five servers from the package and the operator's config; the
model is ``tests/stub_model.py``. Needs the environment ``scripts/gym_env.sh`` builds (Python
3.13 and about 1.5 GB); without it every test here is skipped, saying so. ``.ci/run`` builds it.

Real clock throughout: these are other processes. One deployment is shared by the tests that
leave it standing — with Gym's model-call and token-ID capture switched on, so its records are
finished by Gym's own code and compared with Gym's own collection's — and the tests that kill
something start their own.
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
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import yaml

from tests.fake_gym import FakeHeadServer, agent_instance
from tests.helpers import read_reply, request_bytes, tcp_exchange
from tests.real_gym import (
    REPO,
    Launched,
    RealGym,
    by_identity,
    comparable,
    environment_of,
    gym_global_config,
    gyms_own_collection,
    launched_host,
    prebuilt_venvs,
    read_jsonl,
    row,
    tagged_processes,
    taskset_row,
    weather_package,
)
from tests.scrape import scrape, value
from trio_gym.runners.gym import GLOBAL_CONFIG_NAME

pytestmark = pytest.mark.real_gym

START_TIMEOUT_S = 240  # Ray and five servers on two shared cores; 20-30 s when idle
HANG_GUARD_S = 120
ROWS = [("Accept", "application/x-ndjson")]


@attrs.frozen
class Deployment:
    launched: Launched
    port: int
    tag: str
    head: str
    """Where Gym's head server is (host:port)."""


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
                    port, tag = listening["port"], starting["deployment"]
                    return Deployment(launched, port, tag, starting["head_server"])
            except urllib.error.HTTPError as exc:
                answer = json.load(exc)
                if answer["status"] == "failed":
                    pytest.fail(f"the host failed to start: {answer}")
        time.sleep(0.25)  # clock-ok
    pytest.fail(f"not up within {START_TIMEOUT_S} s; last /health: {answer}")


@contextmanager
def deployment(
    tmp_path: Path, gym: RealGym, captures: Path | None = None, **host_env: str
) -> Iterator[Launched]:
    """A host of its own, launched as a sandbox launches it (not yet waited for); with
    ``captures``, Gym's config switches its capture on into that folder."""
    package = weather_package(tmp_path / "environment", gym.site)
    leave_out = (
        tuple(host_env.pop("LEAVE_OUT_VENV", "").split(",")) if "LEAVE_OUT_VENV" in host_env else ()
    )
    venvs = prebuilt_venvs(tmp_path / "venvs", gym.python, leave_out=leave_out)
    config = gym_global_config(gym.stub.url, venvs, captures)
    with launched_host(tmp_path, gym.python, package, config, **host_env) as launched:
        yield launched


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared deployment's Gym captures model calls and token ids."""
    return tmp_path_factory.mktemp("captures")


@pytest.fixture(scope="module")
def shared(
    real_gym: RealGym, captures: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """One deployment for the tests that leave it standing, capturing."""
    with deployment(tmp_path_factory.mktemp("shared"), real_gym, captures) as launched:
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


# --- records a trainer can train on: Gym's own finalization, failures as Gym writes them ------


async def trio_gym_run(
    rows: list[dict[str, Any]], port: int, out: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    """The rows through ``trio-gym run`` (this checkout's) against the host on ``port``."""
    rows_file = out.with_suffix(".rows.jsonl")
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [sys.executable, "-m", "trio_gym", "run", str(rows_file)]
    argv += ["--url", f"http://127.0.0.1:{port}", "--out", str(out), *extra]
    run = partial(subprocess.run, argv, cwd=REPO, capture_output=True, text=True, check=False)
    with trio.fail_after(HANG_GUARD_S):
        return await trio.to_thread.run_sync(run)


@contextmanager
def agents_host(
    tmp_path: Path, gym: RealGym, head: str, health: list[dict[str, Any]] | None = None
) -> Iterator[int]:
    """``trio-gym serve --runner agents`` on a deployment that runs already (its head server at
    ``head``), finalizing with the Gym Python; its port once ready. Its ready ``/health`` goes
    to ``health``; without, it must say nothing more than ready."""
    port_file = tmp_path / "agents.port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMP_")}
    env["NMP_GYM_PYTHON"] = gym.python
    argv = [sys.executable, "-m", "trio_gym", "serve", "--runner", "agents"]
    argv += ["--head-server", f"http://{head}", "--port", "0", "--port-file", str(port_file)]
    log = tmp_path / "agents-host.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stderr=sink, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S  # clock-ok
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]  # clock-ok
            if port_file.exists() and port_file.read_text().strip():
                port = int(port_file.read_text())
                url = f"http://127.0.0.1:{port}/health"
                with contextlib.suppress(OSError), urllib.request.urlopen(url) as reply:
                    ready = json.load(reply)
                    if health is None:
                        assert ready == {"status": "ready"}  # it finalizes: nothing to say
                    else:
                        health.append(ready)
                    break
            time.sleep(0.2)  # clock-ok
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=HANG_GUARD_S)


# Where a failure record of ours may differ from Gym's for the same failed /run: Gym's name its
# aiohttp exception and message, ours trio_gym's (which name the server).
OURS_ON_FAILURES = ("_ng_failure_type", "_ng_failure_message")


def without(record: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {key: value for key, value in record.items() if key not in keys}


async def test_records_equal_gyms_own_collection_key_for_key_through_both_runners(
    shared: Deployment, real_gym: RealGym, captures: Path, tmp_path: Path
) -> None:
    rows = [
        row("weather_agent", "what is the weather in sf?", 40),  # rewarded
        row("weather_agent", "weather [no-tool]", 41),  # rewarded 0
        row("weather_agent", "what is the weather in sf? [no-tokens]", 42),  # no token ids
        row("weather_agent", "weather [fail]", 43),  # the model fails: the agent answers 500
        row("weather_session_agent", "what is the weather in sf?", 44),
    ]
    gyms, gyms_failures = await trio.to_thread.run_sync(
        gyms_own_collection, real_gym.python, shared.head, rows, tmp_path / "gym.jsonl", captures
    )
    assert sorted(by_identity(gyms)) == [(40, 0), (41, 0), (42, 0), (44, 0)]
    with agents_host(tmp_path, real_gym, shared.head) as agents_port:
        for runner, port in (("gym", shared.port), ("agents", agents_port)):
            out = tmp_path / f"{runner}.trio.jsonl"
            done = await trio_gym_run(rows, port, out)
            assert done.returncode == 1, done.stderr  # one row failed, and it says where
            assert "1 of 5 examples failed" in done.stderr
            ours = read_jsonl(out)
            # Every result of the chunk is written, in input order, beside the failure.
            assert [r["_ng_task_index"] for r in ours] == [40, 41, 42, 44], runner
            assert comparable(by_identity(ours)) == comparable(by_identity(gyms)), runner
            (failure,) = read_jsonl(out.with_name(f"{out.stem}_failures.jsonl"))
            assert failure["_ng_failure_class"] == "agent_run_error"
            assert failure["_ng_failure_http_status"] == 500
            assert "the stub model refuses" in failure["_ng_failure_response_body"]
            assert without(failure, OURS_ON_FAILURES) == without(gyms_failures[0], OURS_ON_FAILURES)
    tokenless = by_identity(ours)[(42, 0)]
    assert tokenless["mask_sample"] is True  # a sample without token ids is never trained on
    assert tokenless["_ng_token_capture"]["capture_incomplete"] is True
    rewarded = by_identity(ours)[(40, 0)]
    assert rewarded["mask_sample"] is False and rewarded["reward"] == 1.0
    assert len(rewarded["ng_model_call_capture"]["calls"]) == 2
    assert len(rewarded["ng_trajectory"]["model_calls"]) == 2
    assert rewarded["ng_perf"]["num_turns"] == 2 and rewarded["ng_perf"]["total_latency_ms"] > 0


async def test_a_second_run_of_the_same_ids_does_not_double_a_capture(
    shared: Deployment, tmp_path: Path
) -> None:
    rows = [row("weather_agent", "what is the weather in sf?", 45)]
    first = await trio_gym_run(rows, shared.port, tmp_path / "first.jsonl")
    second = await trio_gym_run(rows, shared.port, tmp_path / "second.jsonl")
    assert first.returncode == second.returncode == 0, second.stderr
    for out in ("first.jsonl", "second.jsonl"):
        (record,) = read_jsonl(tmp_path / out)
        assert len(record["ng_model_call_capture"]["calls"]) == 2, out  # not 4 the second time
        assert len(record["ng_trajectory"]["model_calls"]) == 2, out


async def test_rows_without_identity_keys_are_numbered_by_their_place_and_captured(
    shared: Deployment, tmp_path: Path
) -> None:
    rows = [row("weather_agent", f"what is the weather in sf? [row {i}]", 0) for i in range(3)]
    for unnumbered in rows:
        del unnumbered["_ng_task_index"], unnumbered["_ng_rollout_index"]
    done = await trio_gym_run(rows, shared.port, tmp_path / "out.jsonl", "--chunk-size", "2")
    assert done.returncode == 0, done.stderr
    records = read_jsonl(tmp_path / "out.jsonl")
    # Numbered across chunks by their place in the file, as Gym's collection numbers rows.
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in records] == [
        (0, 0),
        (1, 0),
        (2, 0),
    ]
    for place, record in enumerate(records):
        assert record["ng_model_call_capture"]["rollout_id"] == f"{place}-0"
        assert len(record["ng_model_call_capture"]["calls"]) == 2  # captured, and found


async def test_a_token_snapshot_is_retired_once_its_record_is_delivered_and_not_before(
    shared: Deployment, real_gym: RealGym, captures: Path, tmp_path: Path
) -> None:
    tokens = captures / "tokens"
    quick = row("weather_agent", "what is the weather in sf?", 46)
    masked = row("weather_agent", "what is the weather in sf? [no-tokens]", 48)
    hanging = row("weather_agent", "weather [hang]", 47)
    before = await stub_stats(real_gym)
    async with await trio.open_tcp_stream("127.0.0.1", shared.port) as stream:
        await stream.send_all(request_bytes({"examples": [quick, hanging]}))
        # The quick row's two calls answered, the hanging row's call open: the quick row is
        # finished, its answer (the document) not yet delivered.
        await until(lambda: _answered(real_gym, before["calls"] - before["running"] + 2), "")
        await until(lambda: _running(real_gym, before["running"] + 1), "the hanging call")
        await until(lambda: _frozen(tokens / "46-0.tokens.state.json"), "the quick row finished")
        await trio.sleep(1)  # time enough for a retire that would wrongly follow its finish
    # The caller left: its document is never delivered.
    await until(lambda: _disconnects(real_gym, before["disconnects"] + 1), "the cut")
    assert (tokens / "46-0.tokens.jsonl").exists()  # kept: the record never reached anyone
    done = await trio_gym_run([quick, masked], shared.port, tmp_path / "out.jsonl")
    assert done.returncode == 0, done.stderr
    assert not (tokens / "46-0.tokens.jsonl").exists()  # delivered: retired
    assert (tokens / "48-0.tokens.incomplete").exists()  # a masked build keeps its evidence


async def _frozen(state: Path) -> bool:
    """Whether Gym's finalization froze this rollout's token snapshot (its record finished)."""

    def read() -> bool:
        return state.exists() and bool(json.loads(state.read_text()).get("frozen"))

    return await trio.to_thread.run_sync(read)


async def _answered(gym: RealGym, count: int) -> bool:
    stats = await stub_stats(gym)
    return stats["calls"] - stats["running"] >= count


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid:
                    found.append(int(entry.name))
    return found


def finalizer_of(host_pid: int) -> int:
    (worker,) = [p for p in _children(host_pid) if b"finalize_worker.py" in _cmdline(p)]
    return worker


async def test_the_finalizer_killed_mid_batch_fails_only_the_rows_it_was_finishing(
    shared: Deployment, real_gym: RealGym, tmp_path: Path
) -> None:
    with agents_host(tmp_path, real_gym, shared.head) as port:
        host_pid = next(p for p in _children(os.getpid()) if b"--runner\0agents" in _cmdline(p))
        worker = finalizer_of(host_pid)
        before = await stub_stats(real_gym)
        soon = row("weather_agent", "what is the weather in sf? [slow 2]", 50)
        late = row("weather_agent", "what is the weather in sf? [slow 8]", 51)
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            await stream.send_all(request_bytes({"examples": [soon, late]}, headers=ROWS))
            await until(lambda: _running(real_gym, before["running"] + 2), "both model calls")
            os.kill(worker, signal.SIGSTOP)  # its captures cleared; now it answers nothing
            # The soon row's two calls answered: its record waits on the stopped finalizer.
            await until(lambda: _answered(real_gym, before["calls"] - before["running"] + 2), "")
            await trio.sleep(2)  # its /verify and the agent's answer, then the call to finish
            os.kill(worker, signal.SIGKILL)
            with trio.fail_after(HANG_GUARD_S):
                reply = await read_reply(stream)
        restarted = finalizer_of(host_pid)
    lines = lines_of(reply)
    assert lines["done"] == {"done": True, "completed": 1, "failed": 1}
    message = lines[0]["error"]["message"]
    assert "FinalizeFailed: Gym's finalizer exited with status -9" in message
    assert lines[0]["record"]["_ng_failure_class"] == "runner_error"
    assert lines[0]["record"]["_ng_task_index"] == 50
    late_record = lines[1]["result"]  # finished by the finalizer started again
    assert len(late_record["ng_model_call_capture"]["calls"]) == 2
    assert restarted != worker


async def test_an_agents_host_whose_capture_folders_are_elsewhere_says_records_are_not_finalized(
    real_gym: RealGym, tmp_path: Path
) -> None:
    deployment = {
        "weather_agent": agent_instance(9),
        "observability_enabled": True,
        "model_call_capture_dir": "/elsewhere/model-calls",
    }
    head = FakeHeadServer(deployment)
    health: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        head_port = await nursery.start(head.serve)
        start = partial(agents_host, tmp_path, real_gym, f"127.0.0.1:{head_port}", health)

        def up_and_down() -> bool:
            with start():
                return Path("/elsewhere").exists()

        made = await trio.to_thread.run_sync(up_and_down)
        nursery.cancel_scope.cancel()
    (ready,) = health
    assert ready["status"] == "ready"  # its rows still run, unfinished, and it says so
    assert "records are not finalized as Gym's collection finalizes them" in ready["detail"]
    assert "/elsewhere/model-calls named by Gym's config is not a folder" in ready["detail"]
    assert not made  # looked at, never made (Gym's stores make their folders)
    log = (tmp_path / "agents-host.log").read_text()
    assert log.count('"event": "records_not_finalized"') == 1


async def test_metrics_show_the_gym_deployment_its_finalizer_and_gyms_failure_classes(
    shared: Deployment,
) -> None:
    rows = [
        row("weather_agent", "what is the weather in sf?", 40),
        row("weather_session_agent", "weather [fail]", 41),  # Gym's environment_server_failed
    ]
    with trio.fail_after(HANG_GUARD_S):
        before = await scrape(shared.port)
        await tcp_exchange(shared.port, request_bytes({"examples": rows}, headers=ROWS))
        after = await scrape(shared.port)
    assert value(after, "trio_gym_gym_deployment_state", state="up") == 1
    assert value(after, "trio_gym_gym_processes") >= 3  # Gym's head, Ray, its servers
    assert value(after, "trio_gym_stage", stage="ready") == 1

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    classed = grew(
        "trio_gym_examples_total", outcome="failed", failure_class="environment_server_failed"
    )
    assert (
        classed == 1 and grew("trio_gym_examples_total", outcome="completed", failure_class="") == 1
    )
    # Gym's finalization ran for every attempt: three of the failing row (Gym's retries), one more.
    assert grew("trio_gym_finalizer_calls_total", op="finish") == 4
    assert grew("trio_gym_finalizer_calls_total", op="prepare") == 4
    assert value(after, "trio_gym_finalizer_failures_total", op="finish") == 0


IMAGE_AGENT = "responses_api_agents/simple_agent/configs/simple_agent.yaml"


def as_the_orchestrator_chooses(
    config: dict[str, Any], agent: str, resources: str, resources_config: str, *, fallback: bool
) -> None:
    """Put in ``config`` what the upstream orchestrator launches a package with: its component
    choice, and always its own config paths beside it (the model, the resources server's
    config, the image's agent config when it gives that fallback)."""
    model = config["config_paths"][0]
    config["config_paths"] = [model, resources_config, *([IMAGE_AGENT] if fallback else [])]
    config["_nmp_environment_component_selection"] = {
        "agent_instance": agent,
        "resources_server_instance": resources,
        "resources_server_config": resources_config,
        "model_config": model,
        **({"agent_config": IMAGE_AGENT} if fallback else {}),
    }


async def weather_row_on(
    tmp_path: Path, gym: RealGym, package: Path, config: dict[str, Any], agent: str
) -> tuple[dict[str, Any], Launched]:
    """One weather row through a host launched on ``package`` and ``config``: its result."""
    with launched_host(tmp_path, gym.python, package, config) as launched:
        up = await trio.to_thread.run_sync(wait_until_up, launched)
        rows = [row(agent, "what is the weather in sf?", 0)]
        with trio.fail_after(HANG_GUARD_S):
            reply = await tcp_exchange(up.port, request_bytes({"examples": rows}))
    (result,) = reply.json()["results"]
    return result, launched


async def test_a_choice_of_the_packages_own_components_replaces_the_orchestrators_config_paths(
    real_gym: RealGym, tmp_path: Path
) -> None:
    """As the upstream orchestrator launches a package: its component choice, and always its
    own config paths beside it — the image's agent config as a fallback, and the conventional
    path of the resources server, which this package ships under its own file name. Both the
    agent and the resources server are the package's: only the model is added (issue 27)."""
    package = weather_package(tmp_path / "environment", real_gym.site)
    config = gym_global_config(
        real_gym.stub.url, prebuilt_venvs(tmp_path / "venvs", real_gym.python)
    )
    conventional = "resources_servers/weather_tools/configs/weather_tools.yaml"  # exists nowhere
    as_the_orchestrator_chooses(
        config, "weather_agent", "weather_tools", conventional, fallback=True
    )
    result, launched = await weather_row_on(tmp_path, real_gym, package, config, "weather_agent")
    assert result["reward"] == 1.0 and result["agent_ref"] == {"name": "weather_agent"}
    (replaced,) = [e for e in launched.events() if e["event"] == "gym_config_paths_replaced"]
    assert replaced["dropped"] == [conventional, IMAGE_AGENT]


async def test_a_temp_directory_too_long_for_rays_sockets_fails_the_start_naming_it(
    real_gym: RealGym, tmp_path: Path
) -> None:
    """A sandbox whose TMPDIR lies deep in its work path: Ray, which Gym starts, could not bind
    its sockets (AF_UNIX paths are at most 107 bytes). The host says so before Gym starts."""
    deep = tmp_path / ("work-" + "x" * 40) / "tmp"
    deep.mkdir(parents=True)
    with deployment(tmp_path, real_gym, TMPDIR=str(deep)) as launched:
        with trio.fail_after(HANG_GUARD_S):
            while (listening := launched.event("listening")) is None:  # noqa: ASYNC110 - another process
                await trio.sleep(0.05)
            answer = await health(listening["port"])
            while answer.json()["status"] != "failed":
                await trio.sleep(0.05)
                answer = await health(listening["port"])
    error = answer.json()["error"]["message"]
    assert answer.json()["stage"] == "starting_gym"
    assert f"({deep}/ray/session_" in error and "over the 107 bytes" in error
    assert launched.event("gym_starting") is None  # no Gym process was started for nothing


@pytest.mark.parametrize("fallback", [True, False], ids=["with-agent-config", "without"])
async def test_a_choice_of_the_packages_agent_and_the_images_resources_server_loads_the_images(
    real_gym: RealGym, tmp_path: Path, fallback: bool
) -> None:
    """The package ships only an agent; the choice names it and the image's weather resources
    server: the resources server's config comes from the choice, the agent config never, with
    or without a fallback (the upstream rule), and rows run on the package's agent."""
    root = tmp_path / "environment"
    agent_config = "responses_api_agents/pkg_weather/configs/agent.yaml"
    (root / agent_config).parent.mkdir(parents=True)
    agent = {
        "entrypoint": "app.py",
        "resources_server": {"type": "resources_servers", "name": "example_single_tool_call"},
        "model_server": {"type": "responses_api_models", "name": "policy_model"},
    }
    (root / agent_config).write_text(
        yaml.safe_dump({"pkg_weather_agent": {"responses_api_agents": {"simple_agent": agent}}})
    )
    manifest = {"format": "native-v1", "config_paths": [agent_config], "metadata": {"name": "p"}}
    (root / "nemo-environment.yaml").write_text(yaml.safe_dump(manifest))
    venvs = prebuilt_venvs(tmp_path / "venvs", real_gym.python)
    config = gym_global_config(real_gym.stub.url, venvs)
    del config["environment_server_routes"]  # the package's own servers route no taskset here
    model = config["config_paths"][0]
    image_weather = (
        "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml"
    )
    as_the_orchestrator_chooses(
        config, "pkg_weather_agent", "example_single_tool_call", image_weather, fallback=fallback
    )
    result, _ = await weather_row_on(tmp_path, real_gym, root, config, "pkg_weather_agent")
    assert result["reward"] == 1.0 and result["agent_ref"] == {"name": "pkg_weather_agent"}
    written = yaml.safe_load((tmp_path / "work" / "gym" / GLOBAL_CONFIG_NAME).read_text())
    assert written["config_paths"] == [str(root / agent_config), model, image_weather]
