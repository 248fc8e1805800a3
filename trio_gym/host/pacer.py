"""One timer for every heartbeat of the host.

A task that sleeps with ``trio.sleep`` wakes through a cancel scope whose deadline expires by
raising and catching ``Cancelled``; with ten thousand connections beating every second that alone
costs about a third of a core. The pacer keeps every sleeper's wake-up time in a heap, and one
task (run by the server for its lifetime) sleeps until the earliest and wakes the sleepers that
are due through events: the same wake-up times, one cancel scope per round instead of one per
heartbeat.
"""

from __future__ import annotations

import heapq
import itertools

import trio


class Pacer:
    def __init__(self) -> None:
        self._sleepers: list[tuple[float, int, trio.Event]] = []
        self._order = itertools.count()  # ties wake in the order they slept
        self._earlier = trio.Event()
        self._running = False

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until ``deadline`` on trio's clock; cancellable like ``trio.sleep_until``.

        While no pacer task runs (a host driven one connection at a time, without ``serve``),
        the sleeper sleeps on its own.
        """
        if not self._running:
            await trio.sleep_until(deadline)
            return
        woken = trio.Event()
        heapq.heappush(self._sleepers, (deadline, next(self._order), woken))
        if self._sleepers[0][2] is woken:
            self._earlier.set()  # the pacer sleeps until a later time: wake it to sleep less
        await woken.wait()
        if trio.current_time() < deadline:  # woken early: the pacer stopped
            await trio.sleep_until(deadline)

    async def run(self) -> None:
        """Wake sleepers when they are due. A sleeper that was cancelled meanwhile leaves an
        event nobody waits on, dropped when its time comes."""
        self._running = True
        try:
            while True:
                self._earlier = trio.Event()
                if not self._sleepers:
                    await self._earlier.wait()
                    continue
                with trio.move_on_at(self._sleepers[0][0]):
                    await self._earlier.wait()
                    continue
                now = trio.current_time()
                while self._sleepers and self._sleepers[0][0] <= now:
                    heapq.heappop(self._sleepers)[2].set()
        finally:
            self._running = False
            for _, _, woken in self._sleepers:
                woken.set()  # the pacer stops: its sleepers finish sleeping alone
            self._sleepers.clear()
