"""Request deadlines that stand still while something holds them paused.

A checkpoint holds admission closed on every host for as long as it takes; requests in flight
meanwhile are parked, not slow, and their client-side deadlines must not run out because of it.
Several parties may pause at once (a checkpoint, a colocated engine's weight refit), so pauses
are held by *name*: the deadlines run again only when the last holder releases, and one holder's
release never ends another's pause.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import trio


class DeadlineRegistry:
    def __init__(self) -> None:
        self._holders: set[str] = set()
        self._scopes: dict[trio.CancelScope, float] = {}
        """Tracked scope -> its remaining seconds while paused (``math.nan`` while running)."""

    @property
    def holders(self) -> frozenset[str]:
        return frozenset(self._holders)

    def track(self, scope: trio.CancelScope) -> None:
        """Pause ``scope``'s deadline with the others until :meth:`untrack`."""
        self._scopes[scope] = math.nan
        if self._holders:
            self._freeze(scope)

    def untrack(self, scope: trio.CancelScope) -> float:
        """Stop tracking ``scope``; the deadline to carry on with (a paused one counts its
        remaining time from now)."""
        remaining = self._scopes.pop(scope, math.nan)
        return scope.deadline if math.isnan(remaining) else trio.current_time() + remaining

    def pause(self, holder: str) -> None:
        """Stop every tracked deadline (idempotent per holder)."""
        if not self._holders:
            for scope in self._scopes:
                self._freeze(scope)
        self._holders.add(holder)

    def release(self, holder: str) -> None:
        """End ``holder``'s pause; deadlines run on, from where they stood, once no holder is
        left. Releasing a holder that holds nothing is a no-op."""
        if holder not in self._holders:
            return
        self._holders.discard(holder)
        if not self._holders:
            now = trio.current_time()
            for scope, remaining in self._scopes.items():
                scope.deadline = now + remaining
                self._scopes[scope] = math.nan

    def _freeze(self, scope: trio.CancelScope) -> None:
        self._scopes[scope] = scope.deadline - trio.current_time()
        scope.deadline = math.inf


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
