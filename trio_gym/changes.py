"""The one way anything here waits for a change: every waiter sleeps until the next ``note`` and
then looks again at what it waits for, so a change is never missed (checking and waiting with no
``await`` between them) and no value is handed over that could go stale."""

from __future__ import annotations

from collections.abc import Callable

import trio


class Changes:
    """Something that changes, and those waiting for it to."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = trio.Event()

    def note(self) -> None:
        """Wake every waiter; synchronous, so any code may call it."""
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        """Sleep until the next :meth:`note` (cancellable)."""
        await self._event.wait()

    async def until(self, holds: Callable[[], bool]) -> None:
        """Return once ``holds()`` is true, looking again at each change (at once if it is)."""
        while not holds():
            await self._event.wait()
