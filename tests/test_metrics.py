"""``GET /metrics`` on real host processes: each metric moves as its event happens, the
exposition parses with Prometheus's own parser, and it answers at every stage of a host's life.
(Real processes on real sockets: the clock is the real one, and waits poll the metrics.)"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.fake_gym import FakeAgentServer
from tests.helpers import CountingRunner, exchange, request_bytes, running_host, tcp_exchange
from tests.processes import LogReader, run_trio_gym, write_examples
from tests.scrape import Samples, parse, scrape, value
from trio_gym.config import ServeConfig
from trio_gym.exposition import render
from trio_gym.host import Host, handle_connection
from trio_gym.host.metrics import HostCollector
from trio_gym.host.stats import MAX_FOREIGN_LABELS, OTHER, ForeignLabels
from trio_gym.protocol.control import PREPARE, RESTORE, RESUME
from trio_gym.trainer.hosts import HealthStatus, HostHandle
from trio_gym.trainer.status import read_host

HANG_GUARD_S = 60


async def until(port: int, holds: Callable[[Samples], object]) -> Samples:
    """Scrape until ``holds`` (a real process moves on its own clock)."""
    with trio.fail_after(HANG_GUARD_S):
        while not holds(samples := await scrape(port)):  # noqa: ASYNC110 (another process)
            await trio.sleep(0.05)
    return samples


@asynccontextmanager
async def host_process(
    *args: str, ready: bool = True, **env: str
) -> AsyncIterator[tuple[trio.Process, int]]:
    """``trio-gym serve`` on a loopback port, its log read (and drained) meanwhile."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_gym", "serve", "--port", "0", *args],
        stderr=subprocess.PIPE,
        env={**os.environ, **env},
    )
    assert process.stderr is not None
    logs = LogReader(process.stderr)
    try:
        with trio.fail_after(HANG_GUARD_S):
            port = (await logs.wait_for("listening"))["port"]
            if ready:
                await logs.wait_for("ready")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, logs)
            yield process, port
            nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def _drain(logs: LogReader) -> None:
    while await logs.next_event() is not None:
        pass


def batch(*examples: Mapping[str, Any], **fields: Any) -> bytes:
    return request_bytes({"examples": list(examples), **fields})


LONG = {"seed": 1, "meetings": 3, "think_s": 600}
GET_METRICS = request_bytes(method="GET", target="/metrics")


async def hold(port: int, request: bytes) -> trio.SocketStream:
    """A batch taken and held: once its answer's head has arrived, the host has let it in
    (the host admits connections in whatever order it schedules them: a scrape sent after an
    unanswered request may take its place)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(request)
    head = b""
    with trio.fail_after(HANG_GUARD_S):
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(65536)
    assert head.startswith(b"HTTP/1.1 200"), head
    return stream


async def test_each_metric_moves_as_its_event_happens() -> None:
    async with host_process("--heartbeat-interval", "0.1", NMP_MAX_CONNECTIONS="2") as (_, port):
        before = await scrape(port)
        assert value(before, "trio_gym_stage", stage="ready") == 1

        refused = await tcp_exchange(port, request_bytes(b"{not json"))
        assert refused.status == 400
        # Exactly what happened between two scrapes: the refused request and the scrape itself.
        mid = await scrape(port)
        assert (
            value(mid, "trio_gym_connections_accepted_total")
            - value(before, "trio_gym_connections_accepted_total")
            == 2
        )
        assert value(mid, "trio_gym_received_bytes_total") - value(
            before, "trio_gym_received_bytes_total"
        ) == len(request_bytes(b"{not json")) + len(GET_METRICS)
        done = await tcp_exchange(port, batch({"seed": 1, "meetings": 2}, {"seed": 2}))
        assert done.status == 200 and done.complete
        late = await tcp_exchange(port, batch(LONG, deadline_s=0.5))
        assert late.json()["error"]["code"] == "deadline_exceeded"

        left = await hold(port, batch(LONG))
        await until(port, lambda s: value(s, "trio_gym_examples_in_flight") == 1)
        await left.aclose()
        after = await until(
            port, lambda s: value(s, "trio_gym_batches_total", outcome="caller_gone")
        )

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("trio_gym_requests_refused_total", code="invalid_request") == 1
    assert grew("trio_gym_batches_total", outcome="ok") == 1
    assert grew("trio_gym_batches_total", outcome="deadline_exceeded") == 1
    assert grew("trio_gym_batches_total", outcome="caller_gone") == 1
    assert grew("trio_gym_examples_total", outcome="completed", failure_class="") == 2
    assert grew("trio_gym_examples_total", outcome="cancelled", failure_class="") == 2
    assert grew("trio_gym_example_duration_seconds_count", outcome="completed") == 2
    assert grew("trio_gym_example_duration_seconds_count", outcome="cancelled") == 2
    assert value(after, "trio_gym_batches_in_flight") == 0
    assert value(after, "trio_gym_examples_in_flight") == 0
    # The deadline's batch was held 0.5 s at 0.1 s a beat; each beat's lateness was observed.
    beats = grew("trio_gym_heartbeats_total")
    assert beats >= 3
    assert grew("trio_gym_heartbeat_lateness_seconds_count") == beats
    assert grew("trio_gym_received_bytes_total") > len(batch(LONG, deadline_s=0.5))
    assert grew("trio_gym_sent_bytes_total") > len(done.body)


async def test_a_full_host_still_answers_its_metrics_and_counts_whom_it_refused() -> None:
    async with host_process(NMP_MAX_CONNECTIONS="2") as (_, port):
        held = [await hold(port, batch(LONG)) for _ in range(2)]
        await until(port, lambda s: value(s, "trio_gym_batches_in_flight") == 2)
        busy = await tcp_exchange(port, batch({"seed": 3}))
        assert busy.status == 503 and busy.json()["error"]["code"] == "host_busy"
        samples = await scrape(port)  # over the cap, as the refused batch was
        for stream in held:
            await stream.aclose()
    assert value(samples, "trio_gym_connections_open") == 2
    # The refused batch, not the scrapes over the cap that were answered.
    assert value(samples, "trio_gym_connections_refused_total", reason="busy") == 1
    assert value(samples, "trio_gym_requests_refused_total", code="host_busy") == 1


async def test_a_gym_failure_record_is_counted_by_its_class() -> None:
    agent = FakeAgentServer("weather")
    async with trio.open_nursery() as nursery:
        agent_port = await nursery.start(agent.serve)
        url = f"http://127.0.0.1:{agent_port}"
        async with host_process("--runner", "agents", "--agent", f"weather={url}") as (_, port):
            row = {
                "agent_ref": {"name": "weather"},
                "_fake": {"failure_class": "agent_timeout", "fail_times": 9, "terminal": True},
            }
            reply = await tcp_exchange(port, batch(row, {**row, "_ng_task_index": 7}))
            assert reply.json()["error"]["code"] == "internal"
            samples = await scrape(port)
        nursery.cancel_scope.cancel()
    assert value(
        samples, "trio_gym_examples_total", outcome="failed", failure_class="agent_timeout"
    )
    assert value(samples, "trio_gym_batches_total", outcome="internal") == 1


def test_failure_classes_from_outside_stay_a_bounded_label() -> None:
    labels = ForeignLabels()
    assert labels.bounded("agent_run_error") == "agent_run_error"
    assert labels.bounded("weather:tool_broke") == "weather:tool_broke"  # Gym's namespaced form
    for unsafe in ("Agent Error", "x" * 200, 'a"b', 7, None):
        assert labels.bounded(unsafe) == OTHER
    for n in range(MAX_FOREIGN_LABELS):
        labels.bounded(f"class_{n}")
    assert labels.bounded("one_too_many") == OTHER
    assert labels.bounded("agent_run_error") == "agent_run_error"  # seen before: kept


async def test_metrics_answer_at_every_stage() -> None:
    async with host_process("--runner", "tests.hanging_import_runner:factory", ready=False) as (
        _,
        port,
    ):
        starting = await until(
            port, lambda s: value(s, "trio_gym_stage", stage="starting_runner") == 1
        )
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
        assert health.status == 503
    assert value(starting, "trio_gym_stage_start_time_seconds") > 1.7e9  # a Unix time

    async with host_process("--runner", "tests.no_such_module:factory", ready=False) as (_, port):
        failed = await until(port, lambda s: value(s, "trio_gym_stage", stage="failed") == 1)

    async with host_process(
        "--runner", "tests.slow_to_stop_runner:factory", NMP_SHUTDOWN_GRACE_S="30"
    ) as (process, port):
        ready = await scrape(port)
        held = await hold(port, batch({}))
        await until(port, lambda s: value(s, "trio_gym_examples_in_flight") == 1)
        process.send_signal(signal.SIGTERM)
        stopping = await until(port, lambda s: value(s, "trio_gym_stage", stage="shutting_down"))
        refused = await tcp_exchange(port, batch({}))
        # It stops once its batch has answered (a 5 s cleanup), not at the end of its 30 s grace.
        with trio.fail_after(15):
            assert await process.wait() == 0
        await held.aclose()
    ready_series = ("trio_gym_stage", frozenset({("stage", "ready")}))
    assert failed[ready_series] == 0 and stopping[ready_series] == 0  # listed, at 0
    assert value(ready, "trio_gym_stage", stage="ready") == 1
    assert value(stopping, "trio_gym_batches_in_flight") == 1
    assert refused.json()["error"]["code"] == "shutting_down"


@pytest.mark.parametrize("path", ["/metrics", "/health"])
async def test_monitoring_paths_take_only_get(path: str) -> None:
    async with host_process() as (_, port):
        reply = await tcp_exchange(port, request_bytes(b"{}", target=path))
    assert reply.status == 405 and "GET" in reply.headers["allow"]


def test_the_exposition_holds_no_secret_and_only_bounded_labels() -> None:
    host = Host(ServeConfig(control_token="s3cret-token", job_id="job-secret"))
    for n in range(100):  # an environment naming a new class for every failure, some malformed
        host.services.stats.count_end("failed", 1.0, f"class_{n}" if n % 2 else f"Class {n}!")
    body, _ = render(HostCollector(host.services, gym_processes=0))
    assert b"s3cret-token" not in body and b"job-secret" not in body
    samples = parse(body.decode())
    classes = {
        dict(pairs)["failure_class"]
        for (name, pairs) in samples
        if name == "trio_gym_examples_total"
    }
    assert len(classes) <= MAX_FOREIGN_LABELS + 1 and OTHER in classes  # "" for those with none
    labels = {name for (_, pairs) in samples for name, _ in pairs}
    assert labels == {"stage", "reason", "outcome", "failure_class", "le", "phase"} | {
        "version",
        "runner",
    }


async def test_a_scrape_during_1000_held_batches_answers_and_the_heartbeats_stay_on_time() -> None:
    async with host_process("--heartbeat-interval", "1", NMP_MAX_CONNECTIONS="2000") as (_, port):
        held = []
        try:
            for _ in range(1000):
                held.append(await hold(port, batch(LONG)))
            before = await until(port, lambda s: value(s, "trio_gym_batches_in_flight") == 1000)
            for _ in range(5):
                during = await scrape(port)
                await trio.sleep(0.5)
            after = await scrape(port)
        finally:
            for stream in held:
                await stream.aclose()
    assert value(during, "trio_gym_connections_open") >= 1000
    beats = value(after, "trio_gym_heartbeats_total") - value(before, "trio_gym_heartbeats_total")
    assert beats >= 2 * 1000  # the 2.5 s of scrapes span at least two beats of every batch
    # No beat was written a whole interval late.
    on_time = "trio_gym_heartbeat_lateness_seconds_bucket"
    assert value(after, on_time, le="1.0") == value(after, on_time, le="+Inf")


async def test_trio_gym_run_serves_its_own_metrics_while_it_runs(tmp_path: Path) -> None:
    rows = write_examples(
        tmp_path / "rows.jsonl", [{"seed": n, "meetings": 2, "think_s": 0.5} for n in range(8)]
    )
    async with host_process() as (_, port):
        run = await trio.lowlevel.open_process(
            [
                sys.executable, "-m", "trio_gym", "run", str(rows),
                "--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "out.jsonl"),
                "--chunk-size", "2", "--metrics-port", "0",
            ],
            stderr=subprocess.PIPE,
        )  # fmt: skip
        assert run.stderr is not None
        try:
            with trio.fail_after(HANG_GUARD_S):
                said = b""
                while b"/metrics\n" not in said:
                    said += await run.stderr.receive_some(4096)
                url = said.decode().split("metrics at ", 1)[1].split()[0]
                metrics_port = int(url.rsplit(":", 1)[1].split("/")[0])
                running = await until(
                    metrics_port, lambda s: value(s, "trio_gym_trainer_chunks_in_flight") >= 1
                )
                while await run.stderr.receive_some(4096):
                    pass
                assert await run.wait() == 0
        finally:
            if run.returncode is None:
                run.kill()
                await run.wait()
    assert value(running, "trio_gym_trainer_hosts", state="healthy") == 1
    assert value(running, "trio_gym_trainer_chunks_sent_total") >= 1
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 8


async def status(*args: str) -> subprocess.CompletedProcess[bytes]:
    return await run_trio_gym("status", *args)


async def test_status_once_prints_a_line_per_host_and_says_if_any_is_not_ready() -> None:
    async with host_process() as (_, port):
        url = f"http://127.0.0.1:{port}"
        await tcp_exchange(port, batch({"seed": 1}, {"seed": 2}))
        shown = await status(url, "--interval", "0.2")
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            gone = f"http://127.0.0.1:{free.getsockname()[1]}"  # nothing listens there
        both = await status(url, gone, "--interval", "0.2")
    assert shown.returncode == 0, shown.stderr
    header, line = shown.stdout.decode().splitlines()
    assert header.split() == [
        "HOST",
        "HEALTH",
        "STAGE",
        "BATCHES",
        "EXAMPLES",
        "EX/S",
        "BEAT",
        "LATE",
        "FAILED",
    ]
    assert line.split()[:5] == [url, "ready", "ready", "0", "0"] and line.endswith("none")
    assert both.returncode == 1
    (down,) = [row for row in both.stdout.decode().splitlines() if row.startswith(gone)]
    assert down.split()[1] == "unreachable"


async def tmux(*args: str) -> str:
    """A tmux command on this test's own tmux server; its output."""
    found = await trio.run_process(
        ["tmux", "-L", TMUX_SOCKET, *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**os.environ, "TERM": "xterm-256color"},
    )
    return found.stdout.decode()


TMUX_SOCKET = f"trio-gym-test-{os.getpid()}"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt install tmux)")
async def test_status_on_a_terminal_refreshes_in_place() -> None:
    async with host_process("--heartbeat-interval", "0.1") as (_, port):
        url = f"http://127.0.0.1:{port}"
        command = f"{sys.executable} -m trio_gym status {url} --interval 0.3"
        await tmux("new-session", "-d", "-s", "s", "-x", "160", "-y", "12", command)
        try:

            async def screen_shows(*wanted: str) -> str:
                with trio.fail_after(HANG_GUARD_S):
                    while True:
                        screen = await tmux("capture-pane", "-p", "-t", "s")
                        rows = [row.split() for row in screen.splitlines() if url in row]
                        if rows and all(word in rows[0] for word in wanted):
                            return screen
                        await trio.sleep(0.1)

            first = await screen_shows("ready", "0")
            held = await hold(port, batch(LONG))
            busy = await screen_shows("ready", "1")  # the same line, redrawn: a batch in flight
            await held.aclose()
            await screen_shows("ready", "0")
        finally:
            await tmux("kill-server")
    assert first.count(url) == 1 and busy.count(url) == 1  # drawn in place, not scrolled
    assert "trio-gym status: 1 host(s)" in busy.splitlines()[0]


class StallingRunner:
    """Its example stalls the whole process once (a blocking call): virtual time leaps 0.35 s
    with no task scheduled, just before the batch's first heartbeat is due."""

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self.clock = clock

    def check_example(self, example: Any) -> None:
        pass

    async def run_example(self, example: Any, context: Any) -> Any:
        await trio.sleep(0.9)
        self.clock.jump(0.35)  # due at 1.0, the beat can only be written at 1.25
        await trio.sleep(2.5)
        return {"ok": True}


async def test_a_heartbeats_lateness_is_measured_from_the_time_it_was_due(
    autojump_clock: trio.testing.MockClock,
) -> None:
    host = Host(ServeConfig(port=0, heartbeat_interval_s=1), runner=StallingRunner(autojump_clock))
    async with trio.open_nursery() as nursery:
        client, server = trio.testing.memory_stream_pair()
        nursery.start_soon(handle_connection, host, server)
        reply = await exchange(client, batch({}))
    assert reply.complete and reply.json()["results"] == [{"ok": True}]
    stats = host.services.stats
    lateness = stats.heartbeat_lateness
    # Beats due at 1 (written at 1.25), then at 2.25 and 3.25 on time: the run ended at 3.75.
    assert stats.heartbeats_sent == lateness.count == 3
    assert lateness.total == pytest.approx(0.25, abs=0.002)
    assert lateness.counts[lateness.bounds.index(0.25)] == 1  # in the bucket le="0.25"


BLOCKED = (
    "import runpy, sys; sys.modules['prometheus_client'] = None; "
    "runpy.run_module('trio_gym', run_name='__main__', alter_sys=True)"
)


async def test_without_the_metrics_extra_metrics_say_how_to_get_it() -> None:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", BLOCKED, "serve", "--port", "0"], stderr=subprocess.PIPE
    )
    assert process.stderr is not None
    logs = LogReader(process.stderr)
    try:
        with trio.fail_after(HANG_GUARD_S):
            port = (await logs.wait_for("listening"))["port"]
            reply = await tcp_exchange(port, GET_METRICS, method=b"GET")
            shown = await trio.run_process(
                [sys.executable, "-c", BLOCKED, "status", f"http://127.0.0.1:{port}"],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    finally:
        process.kill()
        await process.wait()
    assert reply.status == 501 and reply.json()["error"]["code"] == "not_implemented"
    assert "pip install 'trio-gym[metrics]'" in reply.json()["error"]["message"]
    assert shown.returncode == 2 and b"trio-gym[metrics]" in shown.stderr
    assert b"Traceback" not in shown.stderr


async def test_a_stopping_host_carries_out_no_control_operation_but_a_resume() -> None:
    """It listens on while its batches answer; a control call made meanwhile starts nothing."""
    host = Host(ServeConfig(port=0, control_token="t"), runner=CountingRunner())
    host.lifecycle.request_shutdown()
    answers = {}
    async with trio.open_nursery() as nursery:
        for operation in (PREPARE, RESTORE, RESUME):
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(handle_connection, host, server)
            headers = [("Authorization", "Bearer t")]
            request = request_bytes(b"{}", target=operation.path, headers=headers)
            answers[operation.name] = await exchange(client, request)
    for name in ("prepare", "restore"):
        assert answers[name].status == 503
        assert answers[name].json()["error"]["code"] == "shutting_down"
    # The resume passed the stop and met its own check: an empty body is not a resume.
    assert answers["resume"].json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize(
    ("identity", "health", "why"),
    [
        ("ours", HealthStatus.READY, ""),
        (
            "",
            HealthStatus.READY,
            "it answers only the holder of its identity: give --identity-file",
        ),
        ("theirs", HealthStatus.WRONG_HOST, "the identity given is not the one this host was"),
    ],
    ids=["held", "none", "another"],
)
async def test_status_reads_a_host_launched_with_an_identity_as_its_holder_only(
    identity: str, health: HealthStatus, why: str
) -> None:
    async with running_host(runner=CountingRunner(), host_identity="ours") as (host, port):
        url = f"http://127.0.0.1:{port}"
        reading = await read_host(HostHandle(url, url, identity=identity), timeout_s=5)
    assert reading.health.status is health
    assert reading.why.startswith(why)
    assert (reading.samples is not None) is (identity == "ours")
