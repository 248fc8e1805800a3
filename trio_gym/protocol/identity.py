"""A row's episode identity, as the host, the trainer and NeMo Gym read it.

A row's *rollout id* is its ``_ng_rollout_id``, else ``"{_ng_task_index}-{_ng_rollout_index}"``
(Gym's own derivation); its *attempt* is ``_ng_attempt_index`` (0 by default). Its *capture key*
— the name it has in checkpoints and in Gym's model-call captures — is the rollout id, with
``-a<N>`` appended for attempt N > 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

ROLLOUT_ID_KEY: Final = "_ng_rollout_id"
ATTEMPT_KEY: Final = "_ng_attempt_index"
TASK_KEY: Final = "_ng_task_index"
ROLLOUT_KEY: Final = "_ng_rollout_index"
EXAMPLE_ID_KEY: Final = "_sg_example_id"
IDENTITY_KEYS: Final = (TASK_KEY, ROLLOUT_KEY, EXAMPLE_ID_KEY, ROLLOUT_ID_KEY, ATTEMPT_KEY)
"""The keys a row's result carries from the row when it lacks them."""


def numbered(row: Mapping[str, Any], position: int) -> dict[str, Any]:
    """The row numbered as Gym's collection numbers rows before dispatch: a task index (its
    ``position`` in the caller's input) and a rollout index (0) where it has none."""
    row = dict(row)
    if row.get(TASK_KEY) is None:
        row[TASK_KEY] = position
    if row.get(ROLLOUT_KEY) is None:
        row[ROLLOUT_KEY] = 0
    return row


def capture_key(rollout_id: str, attempt: int) -> str:
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def attempt_of(row: Mapping[str, Any]) -> int:
    """The row's attempt; raises ``ValueError`` unless it is a non-negative integer."""
    attempt = row.get(ATTEMPT_KEY, 0)
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"{ATTEMPT_KEY} must be a non-negative integer, not {attempt!r}")
    return attempt


def rollout_id_of(row: Mapping[str, Any]) -> str | None:
    """The row's rollout id, given or derived; ``None`` when it carries neither.

    Raises ``ValueError`` for a given one that is not a non-empty string."""
    rollout_id = row.get(ROLLOUT_ID_KEY)
    if rollout_id is None:
        task, rollout = row.get(TASK_KEY), row.get(ROLLOUT_KEY)
        return f"{task}-{rollout}" if task is not None and rollout is not None else None
    if not isinstance(rollout_id, str) or not rollout_id:
        raise ValueError(f"{ROLLOUT_ID_KEY} must be a non-empty string, not {rollout_id!r}")
    return rollout_id


def capture_key_of(row: Mapping[str, Any]) -> str:
    """The capture key of a row that names its rollout (given or derived); raises
    ``ValueError`` for one that names none, or identity keys of the wrong type."""
    rollout_id = rollout_id_of(row)
    if rollout_id is None:
        raise ValueError(f"names no rollout: give it {ROLLOUT_ID_KEY} or {TASK_KEY}/{ROLLOUT_KEY}")
    return capture_key(rollout_id, attempt_of(row))


@attrs.frozen
class EpisodeId:
    rollout_id: str
    attempt: int

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.attempt)

    @classmethod
    def of(cls, row: Mapping[str, Any], assigned: str) -> EpisodeId:
        """The row's identity; ``assigned`` is the rollout id when it carries none.

        Raises ``ValueError`` for identity keys of the wrong type.
        """
        attempt = attempt_of(row)
        return cls(rollout_id_of(row) or assigned, attempt)
