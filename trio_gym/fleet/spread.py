"""``trio-gym run`` over more than one host: hosts given by URL, or launched for the run.

:func:`batch_runner` turns the command's choice of hosts into the one call the command makes:
one URL is a :class:`~trio_gym.trainer.client.RolloutClient` (with its retries); several URLs
are a :class:`~trio_gym.trainer.pool.HostPool`; ``--launch KIND:N`` launches ``N`` hosts
through a provider, runs the pool over them (ejected hosts replaced) and stops them after.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from trio_gym.fleet.launch import HostSpec, Provider
from trio_gym.fleet.local import LocalProvider
from trio_gym.http import Endpoint
from trio_gym.trainer.batch_file import BatchRunner
from trio_gym.trainer.client import RolloutClient
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.hosts import HostHandle
from trio_gym.trainer.metrics import FleetStats
from trio_gym.trainer.pool import HostPool, Progress
from trio_gym.trainer.scheduler import SchedulerSettings

PROVIDERS: dict[str, Callable[[], Provider]] = {"local": LocalProvider}


@attrs.frozen
class Launch:
    """``--launch KIND:N``: launch ``count`` hosts through the provider named ``kind``."""

    kind: str
    count: int

    @classmethod
    def parse(cls, text: str) -> Launch:
        """Raises ``ValueError`` naming what is wrong and what is expected."""
        match = re.fullmatch(r"([a-z]+):([0-9]+)", text)
        if match is None:
            raise ValueError(f"--launch {text!r}: expected KIND:N, e.g. local:4")
        kind, count = match[1], int(match[2])
        if kind not in PROVIDERS:
            raise ValueError(f"--launch {text!r}: no provider {kind!r}; choose {sorted(PROVIDERS)}")
        if count < 1:
            raise ValueError(f"--launch {text!r}: launch at least one host")
        return cls(kind, count)


def batch_runner(
    *,
    urls: Sequence[str],
    launch: Launch | None,
    spec: HostSpec,
    client_settings: ClientSettings,
    pool_settings: SchedulerSettings,
    stats: FleetStats | None = None,
    identity: str = "",
) -> BatchRunner:
    """The call that runs one batch on the hosts chosen (each example's outcome, as
    :data:`~trio_gym.trainer.batch_file.BatchRunner` says), presenting ``identity`` to hosts
    given by URL; raises ``ValueError`` for a choice that cannot work (no hosts, both URLs and
    a launch, a bad URL, an identity for hosts a launch gives their own)."""
    if launch is not None and urls:
        raise ValueError("give --url or --launch, not both")
    if launch is not None and identity:
        raise ValueError("--identity-file is for --url: launched hosts get identities of their own")
    if launch is None and not urls:
        raise ValueError("give the hosts: --url URL (repeatable) or --launch KIND:N")
    for url in urls:
        Endpoint.parse(url)  # a bad URL is refused now, before anything runs

    async def run_pool(
        hosts: Sequence[HostHandle],
        launcher: Provider | None,
        examples: Sequence[Mapping[str, Any]],
        progress: Progress,
    ) -> list[Any]:
        pool = HostPool(
            hosts,
            pool_settings,
            client_settings=client_settings,
            launcher=launcher,
            progress=progress,
            stats=stats,
        )
        async with pool:
            return await pool.outcomes(examples)

    if len(urls) == 1:
        url = urls[0]

        async def run_on_one(
            examples: Sequence[Mapping[str, Any]], progress: Progress
        ) -> list[Any]:
            client = RolloutClient(
                url, client_settings, progress=progress, stats=stats, identity=identity
            )
            return await client.outcomes(examples)

        return run_on_one
    if launch is None:
        given = [
            HostHandle(f"host-{index}", url, identity=identity) for index, url in enumerate(urls)
        ]

        async def run_on_given(
            examples: Sequence[Mapping[str, Any]], progress: Progress
        ) -> list[Any]:
            return await run_pool(given, None, examples, progress)

        return run_on_given

    async def run_on_launched(
        examples: Sequence[Mapping[str, Any]], progress: Progress
    ) -> list[Any]:
        provider = PROVIDERS[launch.kind]()
        async with provider.hosts(launch.count, spec) as launched:
            return await run_pool(launched, provider, examples, progress)

    return run_on_launched
