"""The dispatch gate: the trainer's side of a checkpoint's closed admission.

A dispatcher submits an attempt inside :meth:`DispatchGate.admission`, and marks it DISPATCHED
in the same ledger mutation as the submission — never before it has passed the gate. A
checkpoint :meth:`closes <DispatchGate.close>` the gate: later dispatchers wait at it, and the
close returns only when every admission already under way has ended, so from then on every
attempt the ledger calls DISPATCHED really was submitted and nothing else will be until the gate
opens. (Counting an attempt that was marked and then sat at the gate made a checkpoint wait, in
its drain, for a reply that could not come until the checkpoint itself released the gate.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import trio


class DispatchGate:
    def __init__(self) -> None:
        self._opened = trio.Event()
        self._opened.set()
        self._inside = 0
        self._emptied = trio.Event()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()

    @property
    def admissions_under_way(self) -> int:
        return self._inside

    @contextlib.asynccontextmanager
    async def admission(self) -> AsyncIterator[None]:
        """Wait while the gate is closed; then submit inside the block."""
        while not self._opened.is_set():
            await self._opened.wait()
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1
            if self._inside == 0:
                self._emptied.set()

    async def close(self) -> None:
        """Close the gate and wait until every admission under way has ended. Cancellable;
        the gate stays closed (a checkpoint reopens it on every path with :meth:`open`)."""
        if self._opened.is_set():
            self._opened = trio.Event()
        while self._inside:
            self._emptied = trio.Event()
            await self._emptied.wait()

    def open(self) -> None:
        self._opened.set()
