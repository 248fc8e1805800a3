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
import math
from collections.abc import Callable
from typing import Final

import attrs
import trio

from trio_gym.logs import log_event

# How close together two wake-ups of the pacer may come: heartbeats are seconds apart, and the
# caller watchers it starts (supervision.WATCH_AFTER_S) milliseconds.
RESOLUTION_S: Final = 0.001
# The heap is compacted (stopped beats dropped) when it reaches this size, then twice the live.
COMPACT_AT: Final = 1024


def _stopped() -> None:
    return None


@attrs.define
class Beat:
    interval_s: float
    call: Callable[[], None]
    repeats: bool = True
    stopped: bool = False

    def stop(self) -> None:
        """Never call it again. It stays in the pacer's heap until its time comes (or the heap
        is compacted) but lets go of what it would have called: a short batch's heartbeat
        must not keep its connection alive for an interval after the batch."""
        self.stopped = True
        self.call = _stopped


class Pacer:
    def __init__(self) -> None:
        self._beats: list[tuple[float, int, Beat]] = []
        self._order = itertools.count()  # ties are called in the order they were due
        self._earlier = trio.Event()
        self._wake_at = math.inf
        self._compact_at = COMPACT_AT
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

    def call_after(self, delay_s: float, call: Callable[[], None]) -> Beat:
        """Call ``call()`` once, ``delay_s`` from now, unless the returned beat's ``stop()``
        comes first. As for :meth:`start_every`, ``call`` must not block."""
        if not self._running:
            raise RuntimeError("timed calls need a running pacer (Pacer.run)")
        beat = Beat(delay_s, call, repeats=False)
        self._push(trio.current_time() + delay_s, beat)
        return beat

    def _push(self, at: float, beat: Beat) -> None:
        if len(self._beats) >= self._compact_at:
            self._compact()
        heapq.heappush(self._beats, (at, next(self._order), beat))
        if at < self._wake_at:
            self._earlier.set()  # the pacer sleeps until a later time: wake it to sleep less

    def _compact(self) -> None:
        """Drop stopped beats: thousands of short batches a second each leave one behind."""
        self._beats = [entry for entry in self._beats if not entry[2].stopped]
        heapq.heapify(self._beats)
        self._compact_at = max(COMPACT_AT, 2 * len(self._beats))

    def _call(self, beat: Beat, now: float) -> None:
        try:
            beat.call()
        except Exception:  # a bug in one beat must not stop every heartbeat of the host
            log_event("beat_failed", level=logging.ERROR, exc_info=True)
            return
        if beat.repeats:
            self._push(now + beat.interval_s, beat)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Call beats when they are due, for as long as it runs (started: beats may be added).

        Wakes at most once per ``RESOLUTION_S``: every wake-up is a cancel scope expiring (an
        exception raised and caught), and a stream of short batches would otherwise wake it
        for each one's watcher timer.
        """
        self._running = True
        task_status.started()
        woke = -math.inf
        try:
            while True:
                self._earlier = trio.Event()
                self._wake_at = (
                    max(self._beats[0][0], woke + RESOLUTION_S) if self._beats else math.inf
                )
                with trio.move_on_at(self._wake_at):
                    await self._earlier.wait()
                    continue
                woke = now = trio.current_time()
                while self._beats and self._beats[0][0] <= now:
                    beat = heapq.heappop(self._beats)[2]
                    if not beat.stopped:
                        self._call(beat, now)
        finally:
            self._running = False
            self._wake_at = math.inf
            self._beats.clear()
