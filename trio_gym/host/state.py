"""What all connections of one serving process share, and who may use which part of it.

:class:`Host` is the composition: its :class:`~trio_gym.host.lifecycle.Lifecycle` (start-up,
the runner, stopping) and :class:`~trio_gym.host.admission.Admission` (connection slots) are
the server's; the :class:`Services` are what a request's handler is handed, and all it may use.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import attrs

from trio_gym.config import ServeConfig
from trio_gym.http import HttpLimits, encode_json
from trio_gym.runners import Runner

from .admission import Admission, host_busy
from .checkpoint import Checkpoints
from .episodes import Episodes
from .lifecycle import Lifecycle
from .pacer import Pacer
from .reattach import KeyedBatches
from .stats import HostStats


@attrs.frozen
class ResultsInfo:
    """What every results document carries beside the results."""

    job_id: str
    environment_path: str
    work_path: str

    @functools.cached_property
    def encoded(self) -> bytes:
        """The fields as a JSON object, encoded once per host rather than once per batch."""
        return encode_json(attrs.asdict(self))


@attrs.frozen
class Services:
    """What a request's handler may use, fixed for the host's life."""

    config: ServeConfig
    limits: HttpLimits
    results_info: ResultsInfo
    """What every results document carries beside its results."""
    stats: HostStats
    lifecycle: Lifecycle
    """Whether a batch is accepted now, the runner, and the stop every batch is cancelled by."""
    checkpoints: Checkpoints
    episodes: Episodes
    keyed: KeyedBatches
    """Batches sent with an ``Idempotency-Key``: attachable, and their keys never run twice."""
    pacer: Pacer
    """Wakes every batch's heartbeat (one timer for all of them; see ``pacer``)."""

    @property
    def tracks_episodes(self) -> bool:
        """Whether rows are episodes with identities of their own: with the checkpoint control
        plane on. Off, the host runs rows as the upstream host does — two rows of one identity
        both run, and results gain no identity key the row did not carry."""
        return bool(self.config.control_token)

    def check_batch_room(self) -> None:
        """Return if one more batch may run; else raise ``host_busy``. The one rule that bounds
        the work a host takes on: ``max_batches`` batches running at once, whether a caller is
        attached to them or not (a keyed batch runs on after its caller hung up)."""
        limit = self.config.max_batches
        if self.stats.batches_running >= limit:
            running = f"running its maximum of {limit} batch{'es' if limit != 1 else ''}"
            raise host_busy(running, "max_batches", "NMP_MAX_BATCHES")


class Host:
    """One serving process: given a ``runner``, ready at once (embedding, tests); otherwise
    ``serve`` bootstraps ``config.runner`` while ``/health`` says ``starting``."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        runner: Runner | None = None,
        wall_time: Callable[[], float] = time.time,  # clock-ok: control calls carry wall times
    ) -> None:
        self.config = config
        self.lifecycle = Lifecycle(config, runner=runner, wall_time=wall_time)
        stats = HostStats()
        limits = config.http_limits()
        self.admission = Admission(config, limits, stats)
        checkpoints = Checkpoints(
            participant=self.lifecycle.state_participant,
            runner_reports_boundaries=self.lifecycle.runner_reports_boundaries,
            wall_time=wall_time,
        )
        self.services = Services(
            config=config,
            limits=limits,
            results_info=ResultsInfo(config.job_id, config.environment_path, config.work_path),
            stats=stats,
            lifecycle=self.lifecycle,
            checkpoints=checkpoints,
            episodes=checkpoints.episodes,
            keyed=KeyedBatches(
                grace_s=config.reattach_grace_s,
                retention_s=config.answer_retention_s,
                retention_bytes=config.answer_retention_bytes,
            ),
            pacer=Pacer(),
        )
