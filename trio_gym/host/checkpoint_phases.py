"""The host's checkpoint phases: one table of legal moves, and the one place that moves.

::

    idle       --prepare-->  preparing  --(all parked)-->  prepared  --commit-->  committed
    idle       --restore-->  restored
    any phase  --resume, or the lease running out-->  idle

Each phase also decides what episodes may do: whether admission is open, and whether an episode
reaching a step boundary parks there. :meth:`CheckpointPhases.move` applies both as it moves, so
no other code opens or closes admission or starts or ends parking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import attrs

from trio_gym.protocol.control import CheckpointPhase


@attrs.frozen
class Conduct:
    """What episodes may do in a phase."""

    admission_open: bool
    """New episodes start (a restored episode's own re-dispatch starts whenever nothing parks)."""
    parking: bool
    """An episode at a step boundary waits there; a cancellable replay step is cut short."""


CONDUCT: Final[dict[CheckpointPhase, Conduct]] = {
    CheckpointPhase.IDLE: Conduct(admission_open=True, parking=False),
    CheckpointPhase.PREPARING: Conduct(admission_open=False, parking=True),
    CheckpointPhase.PREPARED: Conduct(admission_open=False, parking=True),
    CheckpointPhase.COMMITTED: Conduct(admission_open=False, parking=True),
    CheckpointPhase.RESTORED: Conduct(admission_open=False, parking=False),
}

# Every legal move, in one place. idle -> idle is the resume of an id this host never saw (a
# trainer aborting everywhere), remembered so that the id is refused as stale afterwards.
TRANSITIONS: Final[dict[CheckpointPhase, frozenset[CheckpointPhase]]] = {
    CheckpointPhase.IDLE: frozenset(
        {CheckpointPhase.PREPARING, CheckpointPhase.RESTORED, CheckpointPhase.IDLE}
    ),
    CheckpointPhase.PREPARING: frozenset({CheckpointPhase.PREPARED, CheckpointPhase.IDLE}),
    CheckpointPhase.PREPARED: frozenset({CheckpointPhase.COMMITTED, CheckpointPhase.IDLE}),
    CheckpointPhase.COMMITTED: frozenset({CheckpointPhase.IDLE}),
    CheckpointPhase.RESTORED: frozenset({CheckpointPhase.IDLE}),
}


class CheckpointPhases:
    """The phase, the checkpoint it belongs to (``None`` when idle), and what episodes may do.

    ``on_move(before, after)`` is told of every move with the conduct before and after it (the
    episode registry, which owns the phases, releases or cuts short what the change concerns).
    """

    def __init__(self, *, on_move: Callable[[Conduct, Conduct], None]) -> None:
        self.phase = CheckpointPhase.IDLE
        self.checkpoint_id: str | None = None
        self._on_move = on_move

    @property
    def conduct(self) -> Conduct:
        return CONDUCT[self.phase]

    def move(self, to: CheckpointPhase, checkpoint_id: str) -> None:
        """Move to ``to`` for ``checkpoint_id`` (forgotten again on reaching ``idle``).
        Raises ``RuntimeError`` for a move the table does not allow: a bug, not a caller's."""
        if to not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"checkpoint phases: illegal move {self.phase} -> {to}")
        before = self.conduct
        self.phase = to
        self.checkpoint_id = None if to is CheckpointPhase.IDLE else checkpoint_id
        self._on_move(before, self.conduct)
