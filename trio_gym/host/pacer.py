"""One timer for every heartbeat of the host.

A task that sleeps with ``trio.sleep`` wakes through a cancel scope whose deadline expires by
raising and catching ``Cancelled``; with ten thousand connections beating every second that alone
costs about a third of a core, and a task per heartbeat costs memory and task switches. The pacer
keeps every wake-up time in a heap, and one task (run by the server for its lifetime) sleeps
until the earliest and then, for each one due, either wakes a sleeper (an event) or calls a
periodic callback (a heartbeat written without waiting): the same times, one cancel scope per
round instead of one per heartbeat, and no task at all for a periodic beat.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable

import attrs
import trio

from trio_gym.logs import log_event


@attrs.define
class Beat:
    interval_s: float
    call: Callable[[], None]
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True  # dropped from the heap when its time comes


class Pacer:
    def __init__(self) -> None:
        self._sleepers: list[tuple[float, int, trio.Event | Beat]] = []
        self._order = itertools.count()  # ties wake in the order they slept
        self._earlier = trio.Event()
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    def start_every(self, interval_s: float, call: Callable[[], None]) -> Beat:
        """Call ``call()`` every ``interval_s`` (first after one interval) until the returned
        beat's ``stop()``. ``call`` runs in the pacer's task: it must not block or raise. (A
        handle, not a context manager: a generator frame per held connection is memory.)"""
        if not self._running:
            raise RuntimeError("periodic calls need a running pacer (Pacer.run)")
        beat = Beat(interval_s, call)
        self._push(trio.current_time() + interval_s, beat)
        return beat

    def _call(self, beat: Beat, now: float) -> None:
        try:
            beat.call()
        except Exception:  # a bug in one beat must not stop every heartbeat of the host
            log_event("beat_failed", level=logging.ERROR, exc_info=True)
            beat.stop()
            return
        self._push(now + beat.interval_s, beat)

    def _push(self, at: float, entry: trio.Event | Beat) -> None:
        heapq.heappush(self._sleepers, (at, next(self._order), entry))
        if self._sleepers[0][2] is entry:
            self._earlier.set()  # the pacer sleeps until a later time: wake it to sleep less

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until ``deadline`` on trio's clock; cancellable like ``trio.sleep_until``.

        While no pacer task runs (a host driven one connection at a time, without ``serve``),
        the sleeper sleeps on its own.
        """
        if not self._running:
            await trio.sleep_until(deadline)
            return
        woken = trio.Event()
        self._push(deadline, woken)
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
                    entry = heapq.heappop(self._sleepers)[2]
                    if isinstance(entry, trio.Event):
                        entry.set()
                    elif not entry.stopped:
                        self._call(entry, now)
        finally:
            self._running = False
            for _, _, entry in self._sleepers:
                if isinstance(entry, trio.Event):
                    entry.set()  # the pacer stops: its sleepers finish sleeping alone
            self._sleepers.clear()
