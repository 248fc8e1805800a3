"""Request deadlines that stand still while something holds them paused.

A checkpoint holds admission closed on every host for as long as it takes; requests in flight
meanwhile are parked, not slow, and their client-side deadlines must not run out because of it.
Several parties may pause at once (a checkpoint, a colocated engine's weight refit), so pauses
are held by *name*: the deadlines run again only when the last holder releases, and one holder's
release never ends another's pause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio

from trio_gym.deadline import PausableDeadline


class DeadlineRegistry:
    def __init__(self) -> None:
        self._holders: set[str] = set()
        self._tracked: dict[trio.CancelScope, PausableDeadline] = {}

    @property
    def holders(self) -> frozenset[str]:
        return frozenset(self._holders)

    def track(self, scope: trio.CancelScope) -> None:
        """Pause ``scope``'s deadline with the others until :meth:`untrack`."""
        deadline = self._tracked[scope] = PausableDeadline(scope)
        if self._holders:
            deadline.pause()

    def untrack(self, scope: trio.CancelScope) -> float:
        """Stop tracking ``scope``; the deadline to carry on with (a paused one counts its
        remaining time from now)."""
        deadline = self._tracked.pop(scope, None)
        return scope.deadline if deadline is None else deadline.at

    def pause(self, holder: str) -> None:
        """Stop every tracked deadline (idempotent per holder)."""
        self._holders.add(holder)
        for deadline in self._tracked.values():
            deadline.pause()

    def release(self, holder: str) -> None:
        """End ``holder``'s pause; deadlines run on, from where they stood, once no holder is
        left. Releasing a holder that holds nothing is a no-op."""
        if holder not in self._holders:
            return
        self._holders.discard(holder)
        if not self._holders:
            for deadline in self._tracked.values():
                deadline.resume()


class RequestDeadline:
    """One request's deadline, carried across the several waits that make it up (a stream's
    head, then each read), each of them paused with the others by ``registry``."""

    def __init__(self, registry: DeadlineRegistry | None, seconds: float) -> None:
        self._registry = registry
        self.at = trio.current_time() + seconds

    @contextlib.contextmanager
    def waiting(self) -> Iterator[trio.CancelScope]:
        """A cancel scope ending at the deadline; check ``cancelled_caught`` after it."""
        with trio.CancelScope(deadline=self.at) as scope:
            if self._registry is None:
                yield scope
                return
            self._registry.track(scope)
            try:
                yield scope
            finally:
                self.at = self._registry.untrack(scope)
