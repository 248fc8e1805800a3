"""The drain's cost per wake against the number of rollouts in the ledger.

A drain waiting for 16 replies in flight is woken by every ledger mutation; this times the whole
wake (the mutation that wakes it, and its O(pending) look) with 2,000 and with 200,000 live
rollouts in the ledger, in the same run, and prints the per-wake time of each and their ratio
(1.0 means the cost does not grow with the ledger):

    python benchmarks/drain.py [wakes]
"""

from __future__ import annotations

import sys
import time

import trio
import trio.testing

from trio_gym.trainer.drain import drain
from trio_gym.trainer.ledger import AttemptState, Ledger

PENDING = 16


async def per_wake(rollouts: int, wakes: int) -> float:
    ledger = Ledger()
    async with ledger.mutation():
        for g in range(rollouts // 2):
            ledger.add_group(f"g{g}", ["http://a", "http://b"])
            for s in (0, 1):
                ledger.move(f"g{g}.{s}", AttemptState.DISPATCHED)
    pending = [f"g{g}.0" for g in range(PENDING)]
    others = [f"g{g}.1" for g in range(PENDING, PENDING + wakes)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain, ledger, pending, 3600.0)
        await trio.testing.wait_all_tasks_blocked()
        started = time.perf_counter()
        for key in others:  # each mutation wakes the drain, which finds its 16 still pending
            async with ledger.mutation():
                ledger.move(key, AttemptState.SEALED)
            await trio.testing.wait_all_tasks_blocked()
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return elapsed / wakes


def main() -> None:
    wakes = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    small = trio.run(per_wake, 2_000 + 2 * wakes, wakes)
    large = trio.run(per_wake, 200_000, wakes)
    print(f"ledger of {2_000 + 2 * wakes:>7,} rollouts: {1e6 * small:6.1f} µs per wake")
    print(f"ledger of {200_000:>7,} rollouts: {1e6 * large:6.1f} µs per wake")
    print(f"ratio (200,000 / small): {large / small:.2f}")


if __name__ == "__main__":
    main()
