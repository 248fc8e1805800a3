"""A batch's identity and lifecycle: its id (and key), its states and their one table of
moves, and the lines it writes to the log — from ``batch_running`` to its one end line."""

from __future__ import annotations

import enum
import itertools
import logging
import secrets
from typing import Any, Final

import attrs
import trio

from trio_gym.deadline import PausableDeadline
from trio_gym.logs import log_event

from .keys import Gone, answer_expired


class BatchState(enum.Enum):
    ACCEPTED = "accepted"
    RUNNING = "running"
    ANSWERING = "answering"  # results are being sent
    FAILING = "failing"  # an error document is being sent
    DONE = "done"  # results delivered
    FAILED = "failed"  # error document delivered
    ABANDONED = "abandoned"  # the caller left; nothing more can be delivered


# Every legal move, in one place.
TRANSITIONS: Final[dict[BatchState, frozenset[BatchState]]] = {
    BatchState.ACCEPTED: frozenset({BatchState.RUNNING}),
    BatchState.RUNNING: frozenset({BatchState.ANSWERING, BatchState.FAILING, BatchState.ABANDONED}),
    BatchState.ANSWERING: frozenset({BatchState.DONE, BatchState.ABANDONED}),
    BatchState.FAILING: frozenset({BatchState.FAILED, BatchState.ABANDONED}),
    BatchState.DONE: frozenset(),
    BatchState.FAILED: frozenset(),
    BatchState.ABANDONED: frozenset(),
}


_BATCH_PREFIX: Final = secrets.token_hex(6)
_batch_numbers: Final = itertools.count(1)


def new_batch_id() -> str:
    """A random prefix drawn once per process, so log lines of different host processes never
    share a batch id, then a count (a random draw per batch is a system call per batch)."""
    return f"{_BATCH_PREFIX}-{next(_batch_numbers)}"


@attrs.define
class Batch:
    """A batch's identity and lifecycle; every transition is checked and logged.

    Two lines at most reach the log at info level: ``batch_running``, written by
    :meth:`log_running` once the batch has lasted a little (supervision calls it), and the line
    of how it ended, which carries the running line's fields when that was never written — a
    short batch is one line, not two. ``answering`` is at debug level: it is on every
    successful batch's way to ``done``, a line for nothing.
    """

    key: str | None = None
    """Its ``Idempotency-Key``, named in each of its lines beside its id."""
    id: str = attrs.field(factory=new_batch_id)
    size: int = 0
    """Examples in it (known once the body is parsed)."""
    state: BatchState = BatchState.ACCEPTED
    deadline: PausableDeadline = attrs.field(factory=lambda: PausableDeadline(trio.CancelScope()))
    """Its examples' scope and deadline, which stands still while an episode of it is parked
    for a checkpoint (time parked is not charged)."""
    accepted_at: float = attrs.field(factory=trio.current_time)
    unlogged_running: dict[str, Any] | None = None
    """The ``batch_running`` line's fields until it is written."""
    failed_with: str | None = None
    """The error code its error document carries, once it is failing."""
    given_up: bool = False
    """Its caller said (``DELETE`` under its key) that it will not come back: it does not
    begin, and once running it ends as a batch whose caller left."""

    @property
    def outcome(self) -> str:
        """How it ended, as ``/metrics`` counts it: ``ok``, ``caller_gone``, the error code it
        was answered with, or ``cut`` (it ended before its answer did: cut off at the end of a
        shutdown's grace, or by a bug, which the log names)."""
        if self.state is BatchState.DONE:
            return "ok"
        if self.state is BatchState.ABANDONED:
            return "caller_gone"
        if self.state is BatchState.FAILED and self.failed_with is not None:
            return self.failed_with
        return "cut"

    def advance(self, to: BatchState, **fields: Any) -> None:
        """Move to ``to``; raises ``RuntimeError`` for a move the table does not allow (a bug)."""
        if to not in TRANSITIONS[self.state]:
            raise RuntimeError(f"batch {self.id}: illegal move {self.state.value} -> {to.value}")
        self.state = to
        if to is BatchState.FAILING:
            self.failed_with = fields.get("code")
        if to is BatchState.RUNNING:
            self.unlogged_running = fields
            return
        level = logging.INFO
        if to is BatchState.ANSWERING:
            level = logging.DEBUG
        elif self.unlogged_running is not None:
            fields = {**self.unlogged_running, **fields}
            self.unlogged_running = None
        self._log(to, level, fields)

    def log_running(self) -> None:
        """Write the ``batch_running`` line, unless it was written or the batch has ended."""
        if self.unlogged_running is not None and self.state is BatchState.RUNNING:
            self._log(BatchState.RUNNING, logging.INFO, self.unlogged_running)
            self.unlogged_running = None

    @property
    def named(self) -> str:
        """How a message names it: its id, and its key if it has one."""
        return f"batch {self.id}" + ("" if self.key is None else f", Idempotency-Key {self.key}")

    def check_still_wanted(self) -> None:
        """Raise the ``410`` of a batch its caller gave up (``DELETE``) before it ran: that
        answer was a promise that it never will."""
        if self.given_up:
            raise answer_expired(self.key or "", Gone.GIVEN_UP.value)

    @property
    def ran(self) -> bool:
        """Whether any of its examples may have started (past admission, and not empty)."""
        return self.state is not BatchState.ACCEPTED and self.size > 0

    def log_cut(self) -> None:
        """The end line of a batch that ran and ended before its answer did: cut off at the end
        of a shutdown's grace, or by a bug (whose traceback the connection's line carries)."""
        if self.state in (BatchState.RUNNING, BatchState.ANSWERING, BatchState.FAILING):
            fields = self.unlogged_running or {}
            self.unlogged_running = None
            self._log("cut", logging.WARNING, {**fields, "was": self.state.value})

    def _log(self, state: BatchState | str, level: int, fields: dict[str, Any]) -> None:
        elapsed = round(trio.current_time() - self.accepted_at, 3)
        named: dict[str, Any] = {"key": self.key} if self.key is not None else {}
        log_event(
            f"batch_{state.value if isinstance(state, BatchState) else state}",
            level=level,
            batch=self.id,
            **named,
            examples=self.size,
            elapsed_s=elapsed,
            **fields,
        )
