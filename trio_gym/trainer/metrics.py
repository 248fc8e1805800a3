"""What the trainer side counts over its hosts, for Prometheus: a :class:`FleetStats` that a
pool, a dispatcher and its checkpoint coordinator share (plain numbers bumped as things happen),
a :class:`FleetCollector` a program registers with its own exporter
(``registry.register(FleetCollector(stats))``), and :func:`serve_metrics`, the exporter of
``trio-gym run --metrics-port``."""

from __future__ import annotations

import collections
import logging
import typing
from collections.abc import Iterator
from functools import partial
from typing import Final

import attrs
import trio

from trio_gym.errors import ErrorCode, WireError
from trio_gym.exposition import (
    Histogram,
    MetricsUnavailable,
    counter,
    counters_by,
    gauge,
    gauges_by,
    histograms,
    render,
)
from trio_gym.http import (
    ConnectionLost,
    HttpConnection,
    HttpLimits,
    SocketTransport,
    read_request_head,
    send_body,
    send_json,
)
from trio_gym.http.h11_build import h11
from trio_gym.logs import log_event
from trio_gym.protocol.rollouts import METRICS_PATH

if typing.TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

HOST_STATES: Final = ("healthy", "suspect", "replacing", "lost")
CHECKPOINT_BOUNDS_S: Final = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@attrs.define
class FleetStats:
    """Counts over every host a trainer sends to. A *chunk* is one request: a pool's chunk of
    a batch, or a dispatcher's slice of a group for one host."""

    hosts: dict[object, collections.Counter[str]] = attrs.field(factory=dict)
    """Per scheduler counting into these stats while it is open: its hosts by state
    (``HOST_STATES``)."""
    chunks_in_flight: int = 0
    chunks_sent: int = 0
    chunks_answered: int = 0
    chunks_requeued: int = 0
    """Sends that no host took, sent again."""
    chunks_failed: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """Chunks given up, by the origin of their failure (sandbox, proxy, client)."""
    ejections: int = 0
    replacements: int = 0
    replacements_failed: int = 0
    checkpoint_seconds: dict[str, Histogram] = attrs.field(factory=dict)
    """How long checkpoints took, by outcome: taken, unavailable, aborted, failed (cancelled, or
    a bug)."""

    def host_states(self) -> collections.Counter[str]:
        """Hosts by state, over every open scheduler that counts here."""
        return sum(self.hosts.values(), collections.Counter())

    def checkpoint_took(self, outcome: str, seconds: float) -> None:
        histogram = self.checkpoint_seconds.get(outcome)
        if histogram is None:
            histogram = self.checkpoint_seconds[outcome] = Histogram(CHECKPOINT_BOUNDS_S)
        histogram.observe(seconds)


class FleetCollector:
    """The families of ``stats``, made as they are at each scrape."""

    def __init__(self, stats: FleetStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        yield gauges_by(
            "trainer_hosts",
            "Hosts by state: healthy, suspect (being probed), replacing, lost.",
            ["state"],
            (((state,), n) for state, n in stats.host_states().items()),
            always=[(state,) for state in HOST_STATES],
        )
        yield gauge("trainer_chunks_in_flight", "Requests in flight.", stats.chunks_in_flight)
        yield counter("trainer_chunks_sent", "Requests sent.", stats.chunks_sent)
        yield counter("trainer_chunks_answered", "Requests answered whole.", stats.chunks_answered)
        yield counter(
            "trainer_chunks_requeued", "Requests no host took, sent again.", stats.chunks_requeued
        )
        yield counters_by(
            "trainer_chunks_failed",
            "Requests given up, by the origin of their failure.",
            ["origin"],
            (((origin,), n) for origin, n in stats.chunks_failed.items()),
            always=[("sandbox",), ("proxy",), ("client",)],
        )
        yield counter("trainer_host_ejections", "Hosts ejected.", stats.ejections)
        yield counter("trainer_host_replacements", "Hosts replaced.", stats.replacements)
        yield counter(
            "trainer_host_replacements_failed",
            "Replacements a provider could not launch.",
            stats.replacements_failed,
        )
        yield histograms(
            "trainer_checkpoint_duration_seconds",
            "How long checkpoints took, by outcome.",
            {(outcome,): histogram for outcome, histogram in stats.checkpoint_seconds.items()},
            labels=["outcome"],
        )


async def serve_metrics(
    stats: FleetStats,
    port: int,
    *,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ``GET /metrics`` with ``stats`` on ``host:port`` until cancelled; reports the
    port bound. Raises ``OSError`` if it cannot listen, :class:`MetricsUnavailable` without
    ``prometheus_client``."""
    render(FleetCollector(stats))  # no exporter that can only fail: say so at the start
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(partial(_answer, stats), listeners)


async def _answer(stats: FleetStats, stream: trio.SocketStream) -> None:
    conn = HttpConnection(SocketTransport(stream.socket), h11.SERVER, HttpLimits())
    try:
        try:
            await _answer_request(stats, conn)
        except WireError as refusal:
            await send_json(conn, refusal.status, refusal.envelope(), headers=refusal.headers)
        await conn.close()
    except ConnectionLost as exc:
        log_event("metrics_caller_gone", level=logging.DEBUG, reason=str(exc))
    except Exception:  # the boundary: a bug here must not end the run it watches
        log_event("metrics_request_failed", level=logging.ERROR, exc_info=True)
    finally:
        await conn.aclose()


async def _answer_request(stats: FleetStats, conn: HttpConnection) -> None:
    """Raises the :class:`WireError` to answer instead."""
    head = await read_request_head(conn)
    if head.method != b"GET" or head.target.partition(b"?")[0] != METRICS_PATH.encode():
        raise WireError(ErrorCode.NOT_FOUND, "this exporter answers GET /metrics only")
    try:
        body, media = render(FleetCollector(stats))
    except MetricsUnavailable as exc:
        raise WireError(ErrorCode.NOT_IMPLEMENTED, str(exc)) from exc
    await send_body(conn, 200, body, content_type=media)
