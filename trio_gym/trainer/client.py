"""The trainer's rollout client: a batch in, each example's result or a correctly named failure
out — against one host, as a pool of that one host.

``await RolloutClient(url).run(examples)`` splits the batch into chunks and sends them through a
:class:`~trio_gym.trainer.pool.HostPool` of the client's host: ``max_in_flight`` chunks at
once, a chunk the host did not take sent again (at most ``max_attempts`` sends) once a probe of
``/health`` finds the host ready (``backoff_s`` between probes), a taken one never. A
:class:`RolloutClient` is also a :class:`~trio_gym.trainer.host_client.HostClient`: ``post`` and
``stream`` send one request as it is. Failures are named as
:mod:`trio_gym.trainer.host_client` says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trio_gym.http import HttpLimits, StreamOpener, open_tcp
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.host_client import ClientSettings, HostClient
from trio_gym.trainer.metrics import FleetStats
from trio_gym.trainer.pool import HostPool, Progress, SilentProgress
from trio_gym.trainer.scheduler import SchedulerSettings


class RolloutClient(HostClient):
    """Runs batches against one host. Async, trio-only; one client may serve many tasks.
    ``progress`` hears every chunk of :meth:`run` and :meth:`outcomes`."""

    def __init__(
        self,
        url: str,
        settings: ClientSettings | None = None,
        *,
        progress: Progress | None = None,
        limits: HttpLimits | None = None,
        opener: StreamOpener = open_tcp,
        deadlines: DeadlineRegistry | None = None,
        headers: Sequence[tuple[str, str]] = (),
        identity: str = "",
        stats: FleetStats | None = None,
    ) -> None:
        super().__init__(
            url, settings, limits=limits, opener=opener, deadlines=deadlines, headers=headers,
            identity=identity,
        )  # fmt: skip
        self.progress: Progress = progress or SilentProgress()
        self.stats = stats or FleetStats()
        """What its runs count (:mod:`trio_gym.trainer.metrics`)."""

    async def run(self, examples: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Run ``examples``; one result per example, in input order (as
        :meth:`HostPool.run <trio_gym.trainer.pool.HostPool.run>`)."""
        async with self._pool() as pool:
            return await pool.run(examples)

    async def outcomes(self, examples: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Run ``examples``; for each, in input order, its result (a failure record, with
        ``failures="records"``) or the :class:`~trio_gym.trainer.errors.RolloutError` its chunk
        failed with."""
        async with self._pool() as pool:
            return await pool.outcomes(examples)

    def _pool(self) -> HostPool:
        settings = self.settings
        return HostPool(
            [self.host],
            SchedulerSettings(
                per_host_in_flight=settings.max_in_flight,
                max_unreached_sends=settings.max_attempts,
                max_host_failures=settings.max_attempts,  # its sends run out first
                probe_interval_s=settings.backoff_s,
            ),
            client_settings=settings,
            progress=self.progress,
            limits=self.limits,
            opener=self.opener,
            stats=self.stats,
        )
