"""A deadline that can stand still: both sides pause time a checkpoint should not charge.

The host pauses a batch's deadline while one of its episodes is parked for a checkpoint; the
trainer pauses its requests' deadlines while a checkpoint holds admission closed. Either way the
waiting is not the work's fault, so the time left is kept and runs on from there.
"""

from __future__ import annotations

import math

import trio


class PausableDeadline:
    """The deadline of ``scope``, which :meth:`pause` stops and :meth:`resume` runs on.

    Paused, the scope's deadline is infinite and the time it had left is kept; resumed, the
    deadline is that much after the resume. Both are idempotent, so several reasons to pause
    (or the same one noticed twice) need no counting here.
    """

    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope = scope
        self._remaining: float | None = None

    @property
    def paused(self) -> bool:
        return self._remaining is not None

    @property
    def at(self) -> float:
        """Where the deadline falls as things stand: if paused, where a resume now puts it."""
        if self._remaining is None:
            return self.scope.deadline
        return trio.current_time() + self._remaining

    def pause(self) -> None:
        if self._remaining is None:
            self._remaining = self.scope.deadline - trio.current_time()
            self.scope.deadline = math.inf

    def resume(self) -> None:
        if self._remaining is not None:
            self.scope.deadline = trio.current_time() + self._remaining
            self._remaining = None
