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

Optional capabilities are protocols of their own, which the host tests with ``isinstance``: a
:class:`StartingRunner`'s ``async def start(self)`` runs once in the host's ``starting_runner``
stage (reach a registry, warm a cache); if it raises, ``/health`` reports ``bootstrap_failed``
with the reason.
While it waits for something, :func:`report_start_progress` says what, and ``/health`` shows it;
something the host should say for as long as it serves (a capability it lacks here) goes to
:func:`report_health_note`. A runner that needs tasks of its own while the host serves (a worker
process it owns) is a :class:`ServedRunner` instead: its ``serve`` runs in the host's background
nursery, beside the connections. A :class:`ClosingRunner`'s ``async def aclose(self)`` runs once
when the host has stopped serving.
``check_example`` is called on the trio thread for small request bodies and on a worker thread
for large ones (over 1 MiB): it must be a pure check, touching no trio or event-loop state.

A runner whose episodes have steps reports each *step boundary* — the points between steps
where the whole episode is plain JSON-able state — with ``await context.boundary(step, state)``,
and runs each step through ``await context.run_step(fn, mode=...)``. During a checkpoint the
host parks episodes at their next boundary (``boundary`` then returns only once the checkpoint
is over). A ``wait`` step (the default) always finishes first; a ``replay`` step — one that is
safe to run again, because its side effects happen only at its very end — may be cut short:
``run_step`` then raises :class:`StepInterrupted`, and the runner goes back to its last
boundary. An episode restored from a checkpoint starts with ``context.restored`` holding the
state of the boundary it was exported at. Runners that never report a boundary (an opaque remote
agent) cannot be captured: checkpoints list their episodes as restarts and never wait for them.
A :class:`BoundaryReporter` promises a boundary from every episode, so a checkpoint waits even
for an episode that has not reached its first.

A runner that keeps episode state of its own beyond the boundary state (a side-effect store)
also implements :class:`StateParticipant`, so a checkpoint exports and restores that state too.

An example that fails with the environment's own account of the failure (NeMo Gym's failure
record) raises :class:`RecordedFailure`; the host hands that record to the caller (a sidecar
row, or in place of the result when the caller asked for failure records). Work that may happen
only once a result has reached the caller (retiring what Gym keeps until then) is registered
with :meth:`ExampleContext.when_delivered`.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import attrs
import trio

StepMode = Literal["wait", "replay"]
T = TypeVar("T")


class StartReports(Protocol):
    """Where a starting runner's reports go (the host)."""

    def progress(self, detail: str) -> None: ...
    def note(self, text: str) -> None: ...


# Where the reports go: set by the host around the start stages. A context variable, so a
# runner's start() (and whatever it calls) can report without being handed the host.
_start_reports: ContextVar[StartReports | None] = ContextVar("trio_gym_start_reports", default=None)


def report_start_progress(detail: str) -> None:
    """Say what a starting runner is waiting for (``/health`` shows it beside the stage)."""
    reports = _start_reports.get()
    if reports is not None:
        reports.progress(detail)


def report_health_note(text: str) -> None:
    """Say something ``/health`` should tell for as long as the host serves (its ``detail``)."""
    reports = _start_reports.get()
    if reports is not None:
        reports.note(text)


@contextmanager
def start_reports_to(reports: StartReports) -> Iterator[None]:
    """Within the block, :func:`report_start_progress` and :func:`report_health_note` go to
    ``reports``."""
    token = _start_reports.set(reports)
    try:
        yield
    finally:
        _start_reports.reset(token)


class StepInterrupted(Exception):
    """A ``replay`` step was cut short by a checkpoint; resume from the last boundary."""


class RecordedFailure(Exception):
    """The example failed, and ``record`` is the environment's own account of how (NeMo Gym's
    failure record, with its ``_ng_failure_class``): what the caller gets for it."""

    def __init__(self, message: str, record: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.record = record


Delivery = Callable[[], None]
"""Told that a result reached the caller. Synchronous, quick, and it must not raise: work it
starts belongs to a task of the runner's own (a failure there is the runner's to log), so an
answer is never held up by it, nor undone when the connection is cancelled after."""


class EpisodeHooks(Protocol):
    """What the host does at an episode's boundaries and steps (parking, cutting replays)."""

    async def boundary(
        self, context: ExampleContext, step: int, state: Mapping[str, Any]
    ) -> None: ...

    async def run_step(
        self, context: ExampleContext, step: Callable[[], Awaitable[T]], mode: StepMode
    ) -> T: ...


@attrs.frozen
class ExampleContext:
    """What the host tells a runner about the example it is running."""

    batch_id: str
    """Unique within this host process; also in every log line about the batch."""
    index: int
    """The example's position in the batch (results come back in this order)."""
    position: int = 0
    """Its position in the caller's whole input: the request's ``row_offset`` plus ``index``."""
    capture_key: str = ""
    """The episode's identity across checkpoints: its rollout id, ``-a<N>`` for attempt N > 0."""
    restored: Mapping[str, Any] | None = None
    """For a restored episode, the boundary state it continues from; else ``None``."""
    hooks: EpisodeHooks | None = None
    deliveries: list[Delivery] = attrs.field(factory=list)
    """What :meth:`when_delivered` registered, for the host to run."""

    def when_delivered(self, delivery: Delivery) -> None:
        """Call ``delivery`` once the result has been handed to the caller (the last byte of
        the answer that carries it written); never, if it is not (the caller left, the batch
        failed, or the host stopped first)."""
        self.deliveries.append(delivery)

    @property
    def example_key(self) -> str:
        """A key unique to this example among the host's live episodes."""
        return self.capture_key or f"{self.batch_id}/{self.index}"

    async def boundary(self, step: int, state: Mapping[str, Any]) -> None:
        """Report that the episode is between steps: ``step`` steps done, ``state`` JSON-able.

        A checkpoint (cancellable). During a checkpoint it returns only when the checkpoint is
        over (time parked is not charged to the batch's deadline).
        """
        if self.hooks is None:
            await trio.lowlevel.checkpoint()
        else:
            await self.hooks.boundary(self, step, state)

    async def run_step(self, step: Callable[[], Awaitable[T]], *, mode: StepMode = "wait") -> T:
        """Run one step. Raises :class:`StepInterrupted` if a ``replay`` step is cut short."""
        if self.hooks is None:
            return await step()
        return await self.hooks.run_step(self, step, mode)


@runtime_checkable
class Runner(Protocol):
    """The runner protocol (see the module docstring for the cancellation contract)."""

    def check_example(self, example: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` saying what is wrong with ``example``; return if it is runnable."""

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        """Run one example to its result; a checkpoint, cancellable at any await."""


@runtime_checkable
class ServedRunner(Runner, Protocol):
    """A runner with tasks of its own for as long as the host serves (a worker process)."""

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start (what ``start`` would do), report it through ``task_status``, then keep what
        it runs until cancelled — the host stopping, after its last connection. Raising before
        it reported is a failed start; after, it must not raise."""


@runtime_checkable
class StartingRunner(Runner, Protocol):
    """A runner with something to do once before the host is ready."""

    async def start(self) -> None:
        """Prepare; raising fails the host's start with the reason."""


@runtime_checkable
class ClosingRunner(Runner, Protocol):
    """A runner that holds something to release once the host has stopped serving."""

    async def aclose(self) -> None:
        """Release it; the host has no connection left by then."""


@runtime_checkable
class BoundaryReporter(Runner, Protocol):
    """A runner every episode of which reports step boundaries (so each can be captured)."""

    reports_boundaries: bool


@attrs.define
class FinalizationCounts:
    """Calls to Gym's record finalization, and those that failed, by operation."""

    calls: collections.Counter[str] = attrs.field(factory=collections.Counter)
    failures: collections.Counter[str] = attrs.field(factory=collections.Counter)


@runtime_checkable
class FinalizingRunner(Runner, Protocol):
    """A runner that may finish records with Gym's own code (``None``: it does not here)."""

    @property
    def finalization(self) -> FinalizationCounts | None: ...


@runtime_checkable
class StateParticipant(Protocol):
    """A runner that holds episode state of its own, exported and restored by checkpoints."""

    participant: tuple[str, str]
    """(server name, kind): how this state appears in an export's manifest."""

    def export_records(self, capture_keys: Sequence[str]) -> list[dict[str, Any]]:
        """JSON records holding the state of these episodes (each names its capture key)."""

    def restore_records(
        self, records: Sequence[Mapping[str, Any]], renames: Mapping[str, str]
    ) -> None:
        """Install exported records, each under the new capture key ``renames`` gives."""

    def discard(self, capture_key: str) -> None:
        """Free what is held for an episode that will not continue."""
