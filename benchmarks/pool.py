"""One host against four local hosts on the same batch, and how fast a pool routes around a
killed host.

Both runs launch their hosts with :class:`~trio_gym.fleet.LocalProvider` and run the same batch
(calendar examples whose policy "thinks" ``think_s`` per step, so an example mostly waits, as a
host waiting on model calls does) through a :class:`~trio_gym.trainer.pool.HostPool` with the
same per-host in-flight limit. Printed: the wall time of each and their ratio, and how many
chunks each of the four hosts ran. Then four hosts run a longer batch, one host is SIGKILLed
mid-batch, and the pool's own log events give the time from the kill until it suspected the
host, ejected it, and had a replacement in its place; and how many chunks failed with it.

    python benchmarks/pool.py [examples] [think_s]
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import sys
import time
from typing import Any

import trio

from trio_gym.fleet import HostSpec, LocalProvider
from trio_gym.logs import LOGGER
from trio_gym.trainer.errors import RolloutError
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.pool import HostPool
from trio_gym.trainer.scheduler import SchedulerSettings

CHUNK_SIZE = 2
PER_HOST_IN_FLIGHT = 2


class PoolEvents(logging.Handler):
    """The pool's events as they happen: (wall time, event, fields)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, str, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(
            (record.created, record.getMessage(), getattr(record, "trio_gym_fields", {}))
        )

    def first(self, event: str) -> float:
        return next(when for when, name, _ in self.seen if name == event)


def batch(count: int, think_s: float) -> list[dict[str, Any]]:
    return [{"seed": index, "meetings": 2, "think_s": think_s} for index in range(count)]


def pool_over(handles: Any, provider: LocalProvider) -> HostPool:
    return HostPool(
        handles,
        SchedulerSettings(per_host_in_flight=PER_HOST_IN_FLIGHT, probe_interval_s=0.1),
        client_settings=ClientSettings(chunk_size=CHUNK_SIZE),
        launcher=provider,
    )


async def timed_run(hosts: int, examples: list[dict[str, Any]], events: PoolEvents) -> float:
    provider = LocalProvider()
    async with provider.hosts(hosts, HostSpec()) as handles, pool_over(handles, provider) as pool:
        events.seen.clear()
        started = time.perf_counter()
        results = await pool.run(examples)
        elapsed = time.perf_counter() - started
    assert len(results) == len(examples)
    return elapsed


async def route_around(examples: list[dict[str, Any]], events: PoolEvents) -> dict[str, float]:
    provider = LocalProvider()
    outcomes: list[Any] = []
    async with (
        provider.hosts(4, HostSpec()) as handles,
        pool_over(handles, provider) as pool,
        trio.open_nursery() as nursery,
    ):

        async def run() -> None:
            outcomes.extend(await pool.outcomes(examples))

        nursery.start_soon(run)
        await trio.sleep(1.0)  # mid-batch: every host has chunks in flight
        events.seen.clear()
        host_pid = provider.host_pid(handles[0])
        assert host_pid is not None
        killed = time.time()
        os.kill(host_pid, signal.SIGKILL)
    failed = sum(isinstance(outcome, RolloutError) for outcome in outcomes)
    return {
        "suspected": events.first("host_suspect") - killed,
        "ejected": events.first("host_ejected") - killed,
        "replaced": events.first("host_replaced") - killed,
        "failed examples": failed,
    }


async def main(count: int, think_s: float) -> None:
    events = PoolEvents()
    LOGGER.addHandler(events)
    LOGGER.setLevel(logging.INFO)
    examples = batch(count, think_s)
    one = await timed_run(1, examples, events)
    four = await timed_run(4, examples, events)
    shares = collections.Counter(
        fields["host"] for _, name, fields in events.seen if name == "chunk_sending"
    )
    print(f"{count} examples (think_s {think_s}), {CHUNK_SIZE} per chunk,", end=" ")
    print(f"{PER_HOST_IN_FLIGHT} in flight per host")
    print(f"  one host    {one:6.2f} s")
    print(f"  four hosts  {four:6.2f} s   one / four = {one / four:.2f}", end="; ")
    print(f"chunks per host {sorted(shares.values())}")
    figures = await route_around(batch(count * 4, think_s), events)
    print("four hosts, one SIGKILLed mid-batch; from the kill:")
    for name in ("suspected", "ejected", "replaced"):
        print(f"  {name:<10} {figures[name] * 1000:8.1f} ms")
    print(f"  examples failed with it: {int(figures['failed examples'])} (the chunks it had taken)")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    count = int(arguments[0]) if arguments else 64
    think_s = float(arguments[1]) if len(arguments) > 1 else 0.25
    trio.run(main, count, think_s)
