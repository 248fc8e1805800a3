"""What a runner is: the one thing the host asks of an environment.

A runner turns one example (a JSON object from the caller's batch) into one result (anything
JSON can hold). The host runs every example of a batch at once, each in its own task inside the
batch's nursery, and cancels them all together when the deadline passes, the caller leaves or
the host stops. So a runner:

- lets ``trio.Cancelled`` propagate (cleanup in ``finally`` is fine; swallowing it is a bug);
- raises any other exception to fail its example: the host reports the example's index, the
  exception and a bounded traceback to the caller;
- keeps no state about an example after returning, beyond what it deliberately stores.

``check_example`` runs for every example before the batch is accepted, so a malformed example
is a ``400`` naming it rather than a failure minutes into the batch.

An optional ``async def start(self)`` runs once in the host's ``starting_runner`` stage (reach a
registry, warm a cache); if it raises, ``/health`` reports ``bootstrap_failed`` with the reason.

A runner whose episodes have steps reports each *step boundary* — the points between steps
where the whole episode is plain JSON-able state — with ``await context.boundary(step, state)``.
The host counts them now; checkpointing parks episodes there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs
import trio

BoundaryHook = Callable[["ExampleContext", int, Mapping[str, Any]], Awaitable[None]]


@attrs.frozen
class ExampleContext:
    """What the host tells a runner about the example it is running."""

    batch_id: str
    """Unique within this host process; also in every log line about the batch."""
    index: int
    """The example's position in the batch (results come back in this order)."""
    on_boundary: BoundaryHook | None = None

    async def boundary(self, step: int, state: Mapping[str, Any]) -> None:
        """Report that the episode is between steps: ``step`` steps done, ``state`` JSON-able.

        A checkpoint (cancellable): a runner calls it at every boundary, before the next step.
        """
        if self.on_boundary is None:
            await trio.lowlevel.checkpoint()
        else:
            await self.on_boundary(self, step, state)

    @property
    def example_key(self) -> str:
        """A key unique to this example within this host process."""
        return f"{self.batch_id}/{self.index}"


@runtime_checkable
class Runner(Protocol):
    """The runner protocol (see the module docstring for the cancellation contract)."""

    def check_example(self, example: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` saying what is wrong with ``example``; return if it is runnable."""

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        """Run one example to its result; a checkpoint, cancellable at any await."""
