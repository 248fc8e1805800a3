"""One timer for every heartbeat of the host.

A task per heartbeat that sleeps with ``trio.sleep`` wakes through a cancel scope whose deadline
expires by raising and catching ``Cancelled``, then writes through a lock and a shield scope;
with ten thousand connections beating every second that saturated a core (BENCHMARKS.md). The
pacer keeps every beat's next time in a heap; one task (run by the server for its lifetime)
sleeps until the earliest and calls each beat that is due — a heartbeat written without waiting.
The same times, one cancel scope per round instead of one per heartbeat, and no task per beat.
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
        self._beats: list[tuple[float, int, Beat]] = []
        self._order = itertools.count()  # ties are called in the order they were due
        self._earlier = trio.Event()
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    def start_every(self, interval_s: float, call: Callable[[], None]) -> Beat:
        """Call ``call()`` every ``interval_s`` (first after one interval) until the returned
        beat's ``stop()``. ``call`` runs in the pacer's task: it must not block. (A handle, not
        a context manager: a generator frame per held connection is memory.)"""
        if not self._running:
            raise RuntimeError("periodic calls need a running pacer (Pacer.run)")
        beat = Beat(interval_s, call)
        self._push(trio.current_time() + interval_s, beat)
        return beat

    def _push(self, at: float, beat: Beat) -> None:
        heapq.heappush(self._beats, (at, next(self._order), beat))
        if self._beats[0][2] is beat:
            self._earlier.set()  # the pacer sleeps until a later time: wake it to sleep less

    def _call(self, beat: Beat, now: float) -> None:
        try:
            beat.call()
        except Exception:  # a bug in one beat must not stop every heartbeat of the host
            log_event("beat_failed", level=logging.ERROR, exc_info=True)
            return
        self._push(now + beat.interval_s, beat)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Call beats when they are due, for as long as it runs (started: beats may be added)."""
        self._running = True
        task_status.started()
        try:
            while True:
                self._earlier = trio.Event()
                if not self._beats:
                    await self._earlier.wait()
                    continue
                with trio.move_on_at(self._beats[0][0]):
                    await self._earlier.wait()
                    continue
                now = trio.current_time()
                while self._beats and self._beats[0][0] <= now:
                    beat = heapq.heappop(self._beats)[2]
                    if not beat.stopped:
                        self._call(beat, now)
        finally:
            self._running = False
            self._beats.clear()
