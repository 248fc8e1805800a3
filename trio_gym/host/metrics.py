"""``GET /metrics``: what the host counts, in Prometheus's text exposition format.

The families are made from the host's own numbers (:class:`~.stats.HostStats`, the lifecycle,
the checkpoint phases, the runner) each time someone scrapes, so the rollout path pays an
addition per event and nothing more. No label carries an example's id, a secret, or a value
without bound (Gym's failure classes are bounded in :mod:`.stats`).
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Final

import trio

import trio_gym
from trio_gym.errors import ErrorCode, WireError
from trio_gym.exposition import (
    PREFIX,
    MetricsUnavailable,
    counter,
    counters_by,
    gauge,
    histograms,
    one_of,
    render,
)
from trio_gym.http import HttpConnection, send_body
from trio_gym.http.h11_build import h11
from trio_gym.protocol.control import CheckpointPhase
from trio_gym.runners.base import FinalizingRunner
from trio_gym.runners.gym import GymState

from .lifecycle import STAGES
from .state import Services

if typing.TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

BATCH_OUTCOMES: Final = (
    "ok",
    "caller_gone",
    "deadline_exceeded",
    "shutting_down",
    "internal",
    "cut",
)


async def answer_metrics(services: Services, conn: HttpConnection, head: h11.Request) -> None:
    """The exposition, at any stage of the host's life (starting, ready, failed, stopping)."""
    gym = services.lifecycle.gym
    tree = gym.tree if gym is not None else None
    # Counting the deployment's processes reads all of /proc: not on the trio thread.
    processes = await trio.to_thread.run_sync(tree.count_processes) if tree is not None else 0
    try:
        body, media = render(HostCollector(services, gym_processes=processes))
    except MetricsUnavailable as exc:
        raise WireError(ErrorCode.NOT_IMPLEMENTED, str(exc)) from exc
    await send_body(conn, 200, body, content_type=media)


class HostCollector:
    """One scrape's families, made from ``services`` as they are now."""

    def __init__(self, services: Services, *, gym_processes: int) -> None:
        self.services = services
        self.gym_processes = gym_processes

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import InfoMetricFamily

        services = self.services
        stats, lifecycle, episodes = services.stats, services.lifecycle, services.episodes
        yield InfoMetricFamily(
            f"{PREFIX}host",
            "The host's build and runner.",
            value={"version": trio_gym.__version__, "runner": services.config.runner},
        )
        yield one_of(
            "stage",
            "The host's stage (1 for the one it is in).",
            "stage",
            STAGES,
            lifecycle.stage,
        )
        yield gauge(
            "stage_start_time_seconds",
            "When the host entered its stage, in seconds since the Unix epoch.",
            lifecycle.stage_started_at,
        )

        yield gauge("connections_open", "Connections being served.", stats.connections_open)
        yield counter(
            "connections_accepted", "Connections let in to be served.", stats.connections_accepted
        )
        yield counters_by(
            "connections_refused",
            "Connections refused: busy (answered 503 host_busy), dropped (closed at once).",
            ["reason"],
            (((reason,), n) for reason, n in stats.connections_refused.items()),
            always=[("busy",), ("dropped",)],
        )
        yield counters_by(
            "requests_refused",
            "Requests refused before an answer began, by error code (any path).",
            ["code"],
            (((code,), n) for code, n in stats.requests_refused.items()),
        )
        yield gauge("batches_in_flight", "Batches running.", stats.batches_running)
        yield counters_by(
            "batches",
            "Batches that ran, by outcome: ok, caller_gone, or the error code answered.",
            ["outcome"],
            (((outcome,), n) for outcome, n in stats.batches_finished.items()),
            always=[(outcome,) for outcome in BATCH_OUTCOMES],
        )
        yield gauge("examples_in_flight", "Examples running.", stats.examples_running)
        yield counters_by(
            "examples",
            "Examples that ended, by outcome and (failed ones) their failure record's class.",
            ["outcome", "failure_class"],
            stats.examples_ended.items(),
            always=[("completed", ""), ("cancelled", "")],
        )
        yield histograms(
            "example_duration_seconds",
            "How long examples ran, by outcome.",
            {(outcome,): histogram for outcome, histogram in stats.example_seconds.items()},
            labels=["outcome"],
        )
        yield counter("heartbeats", "Heartbeat chunks written.", stats.heartbeats_sent)
        yield histograms(
            "heartbeat_lateness_seconds",
            "How long after its time each heartbeat was written.",
            {(): stats.heartbeat_lateness},
        )
        yield counter("received_bytes", "Bytes read from callers.", stats.traffic.read)
        yield counter("sent_bytes", "Bytes written to callers.", stats.traffic.written)
        yield counter(
            "reattaches",
            "Callers attached again to a keyed batch's answer.",
            services.keyed.reattached_total,
        )

        yield one_of(
            "checkpoint_phase",
            "The host's checkpoint phase (1 for the one it is in).",
            "phase",
            [phase.value for phase in CheckpointPhase],
            services.checkpoints.phases.phase.value,
        )
        # Episodes park only while a checkpoint parks them: no walk over every live episode
        # (ten thousand, held) at each scrape otherwise.
        yield gauge(
            "episodes_parked",
            "Episodes parked at a step boundary for a checkpoint.",
            len(episodes.parked()) if episodes.parking else 0,
        )
        yield counter(
            "episodes_restored", "Episodes installed by a restore.", episodes.restored_total
        )
        yield gauge(
            "episodes_restored_waiting",
            "Restored episodes not dispatched again yet.",
            len(episodes.restored),
        )

        if lifecycle.gym is not None:
            yield one_of(
                "gym_deployment_state",
                "The state of the Gym deployment the host owns (1 for the one it is in).",
                "state",
                typing.get_args(GymState),
                lifecycle.gym.state,
            )
            yield gauge(
                "gym_processes", "Processes of the Gym deployment running now.", self.gym_processes
            )
        runner = lifecycle.loaded_runner
        counts = runner.finalization if isinstance(runner, FinalizingRunner) else None
        if counts is not None:
            yield counters_by(
                "finalizer_calls",
                "Calls to Gym's record finalization, by operation.",
                ["op"],
                (((op,), n) for op, n in counts.calls.items()),
            )
            yield counters_by(
                "finalizer_failures",
                "Calls to Gym's record finalization that failed, by operation.",
                ["op"],
                (((op,), n) for op, n in counts.failures.items()),
            )
