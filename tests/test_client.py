"""The trainer-side RolloutClient: round trips against the real host, every classification
rule, every retry rule, concurrency and partition, on virtual clocks where time matters."""

from __future__ import annotations

import json
import pickle
import signal
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from tests.canned import (
    Behaviour,
    CannedHost,
    chunked_response,
    hang_up,
    json_response,
    read_request,
    respond,
    stall,
)
from tests.framing_proxy import FramingProxy
from tests.helpers import URL, CountingRunner, in_memory, running_host
from tests.processes import serve_process
from trio_gym.config import ServeConfig
from trio_gym.host import Host
from trio_gym.http import HttpLimits
from trio_gym.trainer import ClientSettings, HostClient, Origin, RolloutClient, RolloutError
from trio_gym.trainer.errors import Reach

HANG_GUARD_S = 60


class RecordingProgress:
    def __init__(self) -> None:
        self.started: list[tuple[int, int, float]] = []
        self.heartbeats = 0
        self.finished: list[int] = []
        self.failed: list[int] = []

    def chunk_started(self, chunk: int, attempt: int, size: int) -> None:
        self.started.append((chunk, attempt, trio.current_time()))

    def heartbeat(self, chunk: int) -> None:
        self.heartbeats += 1

    def chunk_finished(self, chunk: int, results: Sequence[Any]) -> None:
        self.finished.append(chunk)

    def chunk_failed(self, chunk: int, error: RolloutError) -> None:
        self.failed.append(chunk)


def episodes(count: int, *, think_s: float = 0.0, meetings: int = 3) -> list[dict[str, Any]]:
    return [
        {"seed": i, "meetings": meetings, "think_s": think_s, "_ng_task_index": i}
        for i in range(count)
    ]


# --- round trips against the real host ----------------------------------------------------


async def test_a_long_batch_with_heartbeats_round_trips(autojump_clock: trio.abc.Clock) -> None:
    host = Host(ServeConfig(port=0, rollout_deadline_s=7200), runner=CountingRunner())
    progress = RecordingProgress()
    async with trio.open_nursery() as nursery:
        client = RolloutClient(
            URL, ClientSettings(chunk_size=3), progress=progress, opener=in_memory(nursery, host)
        )
        start = trio.current_time()
        results = await client.run(episodes(7, think_s=600))  # 3 steps x 600 s = 30 minutes
    assert trio.current_time() - start == 1800
    assert [r["_ng_task_index"] for r in results] == list(range(7))
    assert progress.heartbeats >= 3 * 119  # three chunks, a heartbeat every 15 s each


async def test_http_10_mode_round_trips() -> None:
    async with running_host(runner=CountingRunner(), heartbeat_interval_s=0.05) as (host, port):
        progress = RecordingProgress()
        client = RolloutClient(
            f"http://127.0.0.1:{port}",
            ClientSettings(chunk_size=2, http_version="1.0"),
            progress=progress,
        )
        results = await client.run(episodes(3, think_s=0.1))
    assert [r["seed"] for r in results] == [0, 1, 2]
    assert progress.heartbeats == 0  # a 1.0 answer is buffered: nothing before the document


async def test_a_host_started_with_trio_gym_serve_round_trips() -> None:
    async with serve_process("--heartbeat-interval", "0.1") as (process, _, port):
        with trio.fail_after(HANG_GUARD_S):
            progress = RecordingProgress()
            client = RolloutClient(
                f"http://127.0.0.1:{port}", ClientSettings(chunk_size=4), progress=progress
            )
            results = await client.run(episodes(10, think_s=0.1))
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    assert [r["seed"] for r in results] == list(range(10))
    assert progress.heartbeats > 0


async def test_a_host_deadline_arrives_as_a_sandbox_failure_and_is_not_retried(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0, rollout_deadline_s=60), runner=runner)
    async with trio.open_nursery() as nursery:
        client = RolloutClient(URL, opener=in_memory(nursery, host))
        with pytest.raises(RolloutError) as failure:
            await client.run(episodes(2, think_s=100))
    assert failure.value.origin is Origin.SANDBOX
    assert failure.value.code == "deadline_exceeded" and failure.value.reach is Reach.TAKEN
    assert len(runner.started) == 2  # sent once: never re-run


async def test_the_full_batch_arrives_through_the_framing_proxy() -> None:
    async with running_host(runner=CountingRunner(), heartbeat_interval_s=0.05) as (host, port):
        proxy = FramingProxy(port)
        async with trio.open_nursery() as nursery:
            proxy_port = await nursery.start(proxy.serve)
            client = RolloutClient(f"http://127.0.0.1:{proxy_port}", ClientSettings(chunk_size=3))
            results = await client.run(episodes(7, think_s=0.1))
            nursery.cancel_scope.cancel()
    assert [r["seed"] for r in results] == list(range(7))
    assert proxy.framings == ["chunked"] * 3


# --- classification -----------------------------------------------------------------------

HEARTBEATS_THEN_ERROR = chunked_response(
    b" ", b" ", json.dumps({"error": {"code": "internal", "message": "example 0 failed"}}).encode()
)
NESTED_500 = json_response(500, b'{"error": {"code": "internal", "message": "boom"}}')
HOST_413 = json_response(413, b'{"error": {"code": "payload_too_large", "message": "too big"}}')
FLAT_PROXY = json_response(429, b'{"code": "rate_limited", "message": "slow down"}')
HTML_502 = (
    b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/html\r\ncontent-length: 30\r\n\r\n"
    b"<html><h1>502 Bad Gateway</h1>"
)


HEALTH_READY = json_response(200, b'{"status": "ready"}')
DROPPED = respond(json_response(200, b'{"key": "k", "cancelled": true}'))
"""The host's answer to the DELETE a client sends for a request whose head never came."""
HEALTH_STARTING = json_response(503, b'{"status": "starting", "stage": "installing"}')
HEARTBEATS_ONLY = chunked_response(b" ", b" ", b" ")
DIED = chunked_response(b" ", b" ", b'{"results": [', end=False)
OPENSANDBOX_GONE = json_response(
    502,
    b'{"code": "BACKEND_CONNECTION_FAILED", "message": "Could not connect to the backend sandbox '
    b'127.0.0.1:18080: All connection attempts failed"}',
)
OPENSANDBOX_RESPONSE_FAILED = json_response(
    502, b'{"code": "BACKEND_RESPONSE_FAILED", "message": "Backend closed the connection"}'
)
ENVOY_SAID = (
    b"upstream connect error or disconnect/reset before headers. reset reason: connection failure"
)
ENVOY_CONNECT_FAILED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(ENVOY_SAID), ENVOY_SAID)
)
HOST_NOT_READY = json_response(
    503, b'{"error": {"code": "not_ready", "message": "installing the environment"}}'
)
HOST_WRONG = json_response(421, b'{"error": {"code": "wrong_host", "message": "another host"}}')
HOST_BUSY = json_response(503, b'{"error": {"code": "host_busy", "message": "at its maximum"}}')


@pytest.mark.parametrize(
    ("raw", "health", "origin", "reach", "fragment"),
    [
        (NESTED_500, None, Origin.SANDBOX, Reach.REFUSED, "refused the request with HTTP 500"),
        (HOST_413, None, Origin.CLIENT, Reach.REFUSED, "payload_too_large"),
        (HOST_NOT_READY, None, Origin.SANDBOX, Reach.UNREACHED, "503 not_ready"),
        (HOST_WRONG, None, Origin.SANDBOX, Reach.UNREACHED, "421 wrong_host"),
        (OPENSANDBOX_GONE, None, Origin.PROXY, Reach.UNREACHED, "could not reach the host"),
        (ENVOY_CONNECT_FAILED, None, Origin.PROXY, Reach.UNREACHED, "could not reach the host"),
        (HTML_502, None, Origin.PROXY, Reach.UNREACHED, "<h1>502 Bad Gateway"),
        (FLAT_PROXY, None, Origin.PROXY, Reach.TAKEN, "a proxy answered HTTP 429 rate_limited"),
        (OPENSANDBOX_RESPONSE_FAILED, None, Origin.PROXY, Reach.TAKEN, "BACKEND_RESPONSE_FAILED"),
        (HEARTBEATS_THEN_ERROR, None, Origin.SANDBOX, Reach.TAKEN, "failed the batch: internal"),
        (json_response(200, b"\xff\xfe{}"), None, Origin.SANDBOX, Reach.TAKEN, "not UTF-8 JSON"),
        (json_response(200, b"<html>"), None, Origin.SANDBOX, Reach.TAKEN, "'<html>'"),
        (json_response(200, b'{"rows": []}'), None, Origin.SANDBOX, Reach.TAKEN, "unexpected"),
        (json_response(200, b'{"results": 3}'), None, Origin.SANDBOX, Reach.TAKEN, "unexpected"),
        (json_response(200, b'{"results": [1, 2]}'), None, Origin.SANDBOX, Reach.TAKEN, "2 res"),
        (HEARTBEATS_ONLY, CannedHost.REFUSE, Origin.SANDBOX, Reach.TAKEN, "the host is gone"),
        (HEARTBEATS_ONLY, OPENSANDBOX_GONE, Origin.SANDBOX, Reach.TAKEN, "the host is gone"),
        (HEARTBEATS_ONLY, HEALTH_READY, Origin.PROXY, Reach.TAKEN, "still answers"),
        (HEARTBEATS_ONLY, HOST_BUSY, Origin.PROXY, Reach.TAKEN, "still answers"),
        (HEARTBEATS_ONLY, HEALTH_STARTING, Origin.SANDBOX, Reach.TAKEN, "gone or restarted"),
        (DIED, CannedHost.REFUSE, Origin.SANDBOX, Reach.TAKEN, "the host is gone"),
        (DIED, HEALTH_READY, Origin.PROXY, Reach.TAKEN, "still answers"),
    ],
    ids=[
        "host-refusal",
        "host-413",
        "host-not-now",
        "host-wrong-identity",
        "opensandbox-backend-never-reached",
        "envoy-connect-failure",
        "html-502",
        "flat-proxy-envelope",
        "opensandbox-backend-response-failed",
        "200-with-error-document",
        "not-utf8",
        "not-json",
        "wrong-shape",
        "results-not-a-list",
        "result-count",
        "heartbeats-only-host-gone",
        "heartbeats-only-gateway-cannot-reach-host",
        "heartbeats-only-host-alive",
        "heartbeats-only-host-alive-and-busy",
        "heartbeats-only-host-restarted",
        "body-died-host-gone",
        "body-died-host-alive",
    ],
)
async def test_each_answer_is_named_and_taken_or_not_by_one_rule(
    raw: bytes, health: bytes | None, origin: Origin, reach: Reach, fragment: str
) -> None:
    """The rule every scheduler follows, decided where one send's error is built: each answer
    shape's origin and reach; a cut answer is named by asking ``/health``."""
    cut = health is not None or raw in (HEARTBEATS_ONLY, DIED)
    probe: list[Behaviour | None] = []
    if cut:
        probe = [None if health is CannedHost.REFUSE else respond(health or b"")]
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(raw), *probe])
        client = HostClient(URL, ClientSettings(max_reattaches=0), opener=canned.open)
        with pytest.raises(RolloutError) as failure:
            await client.post([{"seed": 1}])
    error = failure.value
    assert (error.origin, error.reach) == (origin, reach)
    assert fragment in error.message
    assert len([body for body in canned.requests if body]) == 1
    assert error.suspect == (cut or reach is Reach.UNREACHED or raw is OPENSANDBOX_RESPONSE_FAILED)


@pytest.mark.parametrize(
    ("raw", "sends"),
    [(HOST_NOT_READY, 3), (HTML_502, 3), (NESTED_500, 1), (FLAT_PROXY, 1)],
    ids=["host-not-now", "html-502", "host-refusal", "taken"],
)
async def test_run_sends_again_only_what_was_not_taken_once_the_host_is_ready(
    raw: bytes, sends: int
) -> None:
    """``run`` is a pool of one host: an unreached chunk goes again (``max_attempts`` sends in
    all) after a probe of ``/health`` says ready; a refused or taken one never."""
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(raw), respond(HEALTH_READY)] * 3)
        client = RolloutClient(URL, ClientSettings(backoff_s=0), opener=canned.open)
        with pytest.raises(RolloutError) as failure:
            await client.run([{"seed": 1}])
    assert len([body for body in canned.requests if body]) == sends
    if sends > 1:
        assert f"not taken by any host in {sends} sends" in failure.value.message
    else:
        assert "chunk 1 failed on host sandbox.invalid:8080" in failure.value.message


async def test_no_response_headers_is_proxy_and_retried() -> None:
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [hang_up, DROPPED, respond(HEALTH_READY)] * 4)
        client = RolloutClient(URL, ClientSettings(backoff_s=0, max_attempts=4), opener=canned.open)
        with pytest.raises(RolloutError) as failure:
            await client.run([{"seed": 1}])
    assert failure.value.origin is Origin.PROXY
    assert "without answering" in failure.value.message
    assert len([body for body in canned.requests if body]) == 4


async def test_a_body_that_dies_after_the_headers_is_sent_exactly_once() -> None:
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(DIED), respond(HEALTH_READY)])
        settings = ClientSettings(backoff_s=0, max_reattaches=0)  # a host that keeps nothing
        client = RolloutClient(URL, settings, opener=canned.open)
        with pytest.raises(RolloutError) as failure:
            await client.run([{"seed": 1}])
    assert (failure.value.origin, failure.value.reach) == (Origin.PROXY, Reach.TAKEN)
    assert "the answer was cut" in failure.value.message
    assert "2 heartbeat(s)" in failure.value.message
    assert [body for body in canned.requests if body] == canned.requests[:1]  # one POST


async def test_a_connection_that_never_landed_is_retried_with_backoff(
    autojump_clock: trio.abc.Clock,
) -> None:
    good = json_response(200, b'{"results": [{"ok": true}]}')
    async with trio.open_nursery() as nursery:
        behaviours = [CannedHost.REFUSE, CannedHost.REFUSE, respond(HEALTH_READY), respond(good)]
        canned = CannedHost(nursery, behaviours)
        client = RolloutClient(URL, ClientSettings(backoff_s=2), opener=canned.open)
        start = trio.current_time()
        results = await client.run([{"seed": 1}])
    assert results == [{"ok": True}]
    # The send, a probe that did not land, the next probe backoff_s later, the send again.
    assert [at - start for at in canned.opened_at] == [0, 0, 2, 2]
    assert [body for body in canned.requests if body] == canned.requests[-1:]


async def test_a_failed_host_is_probed_before_more_and_the_resend_goes_first(
    autojump_clock: trio.abc.Clock,
) -> None:
    good = json_response(200, b'{"results": [{"ok": true}]}')
    progress = RecordingProgress()
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(HEALTH_READY), respond(good)])
        refused: list[float] = []

        async def opener(endpoint: Any) -> trio.abc.Stream:
            if not refused:  # the first send is refused a second in: chunk 2 waits by then
                await trio.sleep(1)
                refused.append(trio.current_time())
                raise ConnectionRefusedError(111, "Connection refused")
            return await canned.open(endpoint)

        settings = ClientSettings(chunk_size=1, max_in_flight=1, backoff_s=10)
        client = RolloutClient(URL, settings, progress=progress, opener=opener)
        await client.run([{"seed": 1}, {"seed": 2}])
    # Nothing more goes to the host until a probe says ready; then the chunk that waited
    # longest goes first.
    assert [(chunk, attempt) for chunk, attempt, _ in progress.started] == [(0, 1), (0, 2), (1, 1)]


async def test_a_request_over_the_hosts_limit_is_a_client_failure_never_sent() -> None:
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(json_response(200, b"{}"))])
        client = RolloutClient(URL, ClientSettings(max_request_bytes=100), opener=canned.open)
        with pytest.raises(RolloutError) as failure:
            await client.run([{"prompt": "x" * 200}])
    assert failure.value.origin is Origin.CLIENT and failure.value.reach is not Reach.UNREACHED
    assert canned.connections == 0


async def test_a_bug_in_this_process_propagates_as_itself() -> None:
    class BrokenProgress(RecordingProgress):
        def chunk_finished(self, chunk: int, results: Sequence[Any]) -> None:
            raise AttributeError("a bug in the trainer's progress display")

    good = json_response(200, b'{"results": [{"ok": true}]}')
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(good)])
        client = RolloutClient(URL, progress=BrokenProgress(), opener=canned.open)
        with pytest.raises(AttributeError, match="progress display"):
            await client.run([{"seed": 1}])


async def test_the_client_deadline_bounds_a_host_that_heartbeats_forever(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0, rollout_deadline_s=10**6), runner=runner)
    async with trio.open_nursery() as nursery:
        client = RolloutClient(
            URL, ClientSettings(request_deadline_s=100), opener=in_memory(nursery, host)
        )
        start = trio.current_time()
        with pytest.raises(RolloutError) as failure:
            await client.run(episodes(1, think_s=3600, meetings=12))
        assert trio.current_time() - start == 100
    assert failure.value.origin is Origin.SANDBOX and failure.value.reach is not Reach.UNREACHED
    assert "6 heartbeat(s)" in failure.value.message  # at 15, 30, ... 90 s
    assert len(runner.started) == 1
    assert len(runner.cancelled) == 1  # the client hung up and the host cancelled the example


async def test_every_chunk_failing_points_at_the_host_and_partial_failure_counts() -> None:
    nested = respond(NESTED_500)
    good = respond(json_response(200, b'{"results": [{"ok": true}]}'))
    async with trio.open_nursery() as nursery:
        all_bad = CannedHost(nursery, [nested])
        client = RolloutClient(URL, ClientSettings(chunk_size=1), opener=all_bad.open)
        with pytest.raises(RolloutError, match="every chunk failed, so the host itself"):
            await client.run([{"a": 1}, {"a": 2}])
        one_bad = CannedHost(nursery, [nested, good])
        client = RolloutClient(
            URL, ClientSettings(chunk_size=1, max_in_flight=1), opener=one_bad.open
        )
        with pytest.raises(RolloutError, match=r"1 of 2 rollout chunk\(s\) failed") as failure:
            await client.run([{"a": 1}, {"a": 2}])
    assert "likelier" not in failure.value.message


# --- partition and concurrency ------------------------------------------------------------


async def test_every_example_is_sent_exactly_once_in_chunks(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0), runner=runner)
    examples = episodes(25, think_s=1)
    async with trio.open_nursery() as nursery:
        client = RolloutClient(URL, ClientSettings(chunk_size=4), opener=in_memory(nursery, host))
        results = await client.run(examples)
    assert [r["seed"] for r in results] == list(range(25))
    assert sorted(r["seed"] for r in results) == list(range(25))
    assert len(runner.started) == 25  # no example ran twice, none was skipped
    assert sorted(index for index, _ in runner.started).count(0) == 7  # 7 chunks: 6x4 + 1


async def test_peak_concurrency_is_exactly_max_in_flight(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0), runner=runner)
    async with trio.open_nursery() as nursery:
        settings = ClientSettings(chunk_size=2, max_in_flight=3)
        client = RolloutClient(URL, settings, opener=in_memory(nursery, host))
        await client.run(episodes(20, think_s=5))
    assert runner.peak == 3 * 2  # three chunks of two at once: never more, and reached


async def test_chunks_are_first_sent_in_input_order(autojump_clock: trio.abc.Clock) -> None:
    host = Host(ServeConfig(port=0), runner=CountingRunner())
    progress = RecordingProgress()
    async with trio.open_nursery() as nursery:
        settings = ClientSettings(chunk_size=2, max_in_flight=2)
        client = RolloutClient(URL, settings, progress=progress, opener=in_memory(nursery, host))
        await client.run(episodes(12, think_s=5))
    assert [chunk for chunk, _, _ in progress.started] == list(range(6))


async def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        await RolloutClient(URL).run([])


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        ClientSettings(max_in_flight=0)


def test_rollout_errors_survive_pickling() -> None:
    error = RolloutError(
        "boom", origin=Origin.PROXY, reach=Reach.UNREACHED, suspect=True, status=502, code="x"
    )
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.message, copy.origin, copy.reach, copy.suspect, copy.status, copy.code) == (
        "boom",
        Origin.PROXY,
        Reach.UNREACHED,
        True,
        502,
        "x",
    )


async def test_a_413_decided_while_the_client_still_uploads_is_read_as_a_client_failure() -> None:
    """The host answers from the declared length and stops draining after drain_max_bytes; the
    client must read that early answer instead of dying on the broken upload."""
    import attrs

    class Draining(ServeConfig):
        def http_limits(self) -> HttpLimits:
            return attrs.evolve(super().http_limits(), drain_max_bytes=1024 * 1024)

    config = Draining(port=0, max_request_bytes=1024 * 1024)
    async with running_host(config, runner=CountingRunner()) as (host, port):
        settings = ClientSettings(max_request_bytes=1024**3, backoff_s=0)
        client = RolloutClient(f"http://127.0.0.1:{port}", settings)
        with trio.fail_after(HANG_GUARD_S), pytest.raises(RolloutError) as failure:
            await client.run([{"seed": 1, "_pad": "x" * (40 * 1024 * 1024)}])
    assert failure.value.origin is Origin.CLIENT and failure.value.reach is not Reach.UNREACHED
    assert failure.value.status == 413
    assert "chunk 1 failed on host" in failure.value.message


async def test_a_client_deadline_before_any_head_is_retried(autojump_clock: trio.abc.Clock) -> None:
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [stall, DROPPED, respond(HEALTH_READY)] * 3)
        settings = ClientSettings(request_deadline_s=10, backoff_s=0)
        client = RolloutClient(URL, settings, opener=canned.open)
        with pytest.raises(RolloutError) as failure:
            await client.run([{"seed": 1}])
        nursery.cancel_scope.cancel()
    assert failure.value.origin is Origin.PROXY and "no response headers" in failure.value.message
    assert len([body for body in canned.requests if body]) == 3


@pytest.mark.parametrize(
    ("behaviour", "reach"),
    [(hang_up, Reach.TAKEN), (CannedHost.REFUSE, Reach.UNREACHED)],
    ids=["hang-up", "refused"],
)
async def test_over_http_10_only_a_connection_that_never_opened_is_unreached(
    behaviour: Any, reach: Reach
) -> None:
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [behaviour, respond(HEALTH_READY)] * 3)
        settings = ClientSettings(http_version="1.0", backoff_s=0)
        with pytest.raises(RolloutError) as failure:
            await RolloutClient(URL, settings, opener=canned.open).run([{"seed": 1}])
    assert failure.value.reach is reach  # a 1.0 host may have run a batch it never answered
    posts = len([body for body in canned.requests if body])
    assert posts == (1 if reach is Reach.TAKEN else 0)


async def test_a_response_over_the_clients_limit_is_a_client_failure() -> None:
    big = json_response(200, b'{"results": ["' + b"x" * 5000 + b'"]}')
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(big)])
        client = RolloutClient(URL, ClientSettings(max_response_bytes=1000), opener=canned.open)
        with pytest.raises(RolloutError) as failure:
            await client.run([{"seed": 1}])
    assert failure.value.origin is Origin.CLIENT and failure.value.reach is not Reach.UNREACHED
    assert len(canned.requests) == 1


@pytest.mark.parametrize(
    ("raw", "origin"),
    [
        (json_response(502, b"[" * 100_000), Origin.PROXY),
        (json_response(200, b"[" * 100_000), Origin.SANDBOX),
        (HTML_502.replace(b"502 Bad Gateway", b"413 Too Large!!"), Origin.CLIENT),
    ],
    ids=["deep-502", "deep-200", "proxy-html-413"],
)
async def test_odd_bodies_are_classified_not_raised(raw: bytes, origin: Origin) -> None:
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(raw)])
        client = RolloutClient(URL, ClientSettings(backoff_s=0), opener=canned.open)
        with pytest.raises(RolloutError) as failure:
            await client.run([{"seed": 1}])
    assert failure.value.origin is origin


def test_a_url_with_a_query_or_spaces_is_refused_up_front() -> None:
    for url in ("http://h:1/a?b=1", "http://h:1/a b", "https://h:1"):
        with pytest.raises(ValueError, match="http"):
            RolloutClient(url)


async def test_a_host_deadline_over_loopback_is_a_sandbox_failure() -> None:
    async with running_host(runner=CountingRunner(), rollout_deadline_s=0.3) as (host, port):
        client = RolloutClient(f"http://127.0.0.1:{port}", ClientSettings(backoff_s=0))
        with pytest.raises(RolloutError) as failure:
            await client.run(episodes(2, think_s=5))
    assert failure.value.origin is Origin.SANDBOX and failure.value.code == "deadline_exceeded"


async def test_an_answer_ends_at_its_message_end_though_a_proxy_keeps_the_connection_open(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A proxy may drop the host's ``Connection: close`` and hold the connection (OpenSandbox's
    does, ~30 s): the client is done at the message's end, not at EOF."""
    document = b'{"results": [{"ok": true}]}'
    kept_open = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"1\r\n \r\n%x\r\n%s\r\n0\r\n\r\n" % (len(document), document),
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(document), document),
    ]
    for raw in kept_open:

        async def answer_and_hold(stream: trio.abc.Stream, raw: bytes = raw) -> None:
            await stream.send_all(raw)
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            canned = CannedHost(nursery, [answer_and_hold])
            client = RolloutClient(URL, ClientSettings(idle_timeout_s=30), opener=canned.open)
            start = trio.current_time()
            assert await client.run([{"seed": 1}]) == [{"ok": True}]
            assert trio.current_time() - start < 1  # not the idle timeout, not the proxy's 30 s
            nursery.cancel_scope.cancel()


async def test_over_http_10_a_proxys_page_may_hide_a_batch_that_ran_so_it_is_taken() -> None:
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(HTML_502)])
        settings = ClientSettings(http_version="1.0", backoff_s=0)
        with pytest.raises(RolloutError) as failure:
            await RolloutClient(URL, settings, opener=canned.open).run([{"seed": 1}])
    assert (failure.value.origin, failure.value.reach) == (Origin.PROXY, Reach.TAKEN)
    assert len(canned.requests) == 1


async def test_a_host_that_never_answers_its_head_is_given_up_on_at_the_head_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A stalled host (SIGSTOP, a wedged proxy) holds no chunk to the request deadline: once
    the request is sent, its head has head_timeout_s; no head over HTTP/1.1 is unreached."""
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [stall, DROPPED, respond(HEALTH_READY)] * 2)
        settings = ClientSettings(head_timeout_s=10, max_attempts=2, backoff_s=0)
        client = RolloutClient(URL, settings, opener=canned.open)
        start = trio.current_time()
        with pytest.raises(RolloutError) as failure:
            await client.run([{"seed": 1}])
        assert trio.current_time() - start == 20  # two sends, 10 s each (a ready probe between)
        nursery.cancel_scope.cancel()
    assert (failure.value.origin, failure.value.reach) == (Origin.PROXY, Reach.UNREACHED)
    assert "within 10 s of the request's end (head_timeout_s)" in failure.value.message


async def test_the_head_timeout_starts_when_the_upload_ends_not_before(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A big chunk to a slow reader: its upload's time is not the head's."""
    answered = json_response(200, b'{"results": [{"ok": true}]}')

    async def slow_reader(endpoint: object) -> trio.abc.Stream:
        client, server = trio.testing.lockstep_stream_pair()

        async def serve() -> None:
            await trio.sleep(25)  # reads nothing for 25 s (within send_timeout_s): it waits
            await read_request(server)
            await trio.sleep(5)  # then answers within the head timeout
            await server.send_all(answered)
            await server.aclose()

        nursery.start_soon(serve)
        return client

    async with trio.open_nursery() as nursery:
        client = RolloutClient(URL, ClientSettings(head_timeout_s=10), opener=slow_reader)
        start = trio.current_time()
        assert await client.run([{"prompt": "x" * 200_000}]) == [{"ok": True}]
        assert trio.current_time() - start == 30  # past head_timeout_s from the start


async def test_over_http_10_the_head_is_bounded_by_the_request_deadline_only(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A 1.0 host answers when the batch is done: its head comes at the end, after any
    head_timeout_s."""
    answered = json_response(200, b'{"results": [{"ok": true}]}')

    async def answer_late(stream: trio.abc.Stream) -> None:
        await trio.sleep(300)
        await stream.send_all(answered)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [answer_late])
        settings = ClientSettings(http_version="1.0", head_timeout_s=10)
        results = await RolloutClient(URL, settings, opener=canned.open).run([{"seed": 1}])
    assert results == [{"ok": True}]


async def test_a_connection_that_never_opens_is_given_up_on_at_the_connect_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def never_connects(endpoint: object) -> trio.abc.Stream:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    settings = ClientSettings(connect_timeout_s=5, max_attempts=3, backoff_s=1)
    start = trio.current_time()
    with pytest.raises(RolloutError) as failure:
        await RolloutClient(URL, settings, opener=never_connects).run([{"seed": 1}])
    # The send, a probe, backoff_s, a probe (each connect_timeout_s), and the host is out.
    assert trio.current_time() - start == 5 + 5 + 1 + 5
    assert (failure.value.origin, failure.value.reach) == (Origin.PROXY, Reach.UNREACHED)
    assert "could not connect to sandbox.invalid:8080 within 5 s" in failure.value.message


async def test_a_request_whose_head_never_came_is_taken_unless_its_host_confirms_dropping_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A host keeps a keyed batch for its caller's return: with no head back and no answer to
    the DELETE that gives it up, the host may still run it, so it is not sent again."""
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [stall])  # the POST, then the DELETE: both unanswered
        settings = ClientSettings(head_timeout_s=10, give_up_timeout_s=2)
        with pytest.raises(RolloutError) as failure:
            await RolloutClient(URL, settings, opener=canned.open).run([{"seed": 1}])
        nursery.cancel_scope.cancel()
    assert failure.value.reach is Reach.TAKEN
    assert "did not confirm it dropped the request" in failure.value.message
    assert len([body for body in canned.requests if body]) == 1  # one POST, never re-sent
