"""A lost host's work moved to its heir inside a run, its episodes of the last checkpoint
restored there exactly once.

When the scheduler loses a host, :func:`recover` (called by the dispatcher, holding
``host_changes`` so no checkpoint is under way) takes every unsealed attempt the ledger places
on it:

- a DISPATCHED attempt the last checkpoint exported from that host (it was still running when
  the host went) is restored on the heir from the export — the host-side restore of those
  capture keys, then a resume — and continues there as its next attempt, from the step it was
  parked at;
- every other DISPATCHED attempt is ABANDONED (the dispatcher runs it afresh, on the heir);
- everything then belongs to the heir (``Ledger.rehost``).

A restore the heir refuses, or that does not answer, is undone there (retired, resumed) and its
episodes run afresh instead: a recovery never fails the run, and never runs an episode twice.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import attrs

from trio_gym.logs import log_event
from trio_gym.protocol.identity import capture_key
from trio_gym.trainer.control import ControlError
from trio_gym.trainer.ledger import AttemptState, Ledger
from trio_gym.trainer.manifest import CheckpointManifest, HostExport
from trio_gym.trainer.scheduler import RemoteHost


@attrs.frozen
class LastCheckpoint:
    """The checkpoint a lost host's episodes come back from: where it is, and what it holds."""

    directory: Path
    manifest: CheckpointManifest


async def recover(
    ledger: Ledger,
    lost: str,
    heir: RemoteHost | None,
    last: LastCheckpoint | None,
    *,
    timeout_s: float,
    lease_s: float,
) -> tuple[list[str], list[tuple[str, int]]]:
    """Move ``lost``'s unsealed work to ``heir`` (none: it stays, abandoned); the capture keys
    of the attempts restored on the heir, and the (rollout id, attempt) the heir restored for
    an attempt given up meanwhile (its group dropped during the restore), to retire there."""
    export = _export_of(lost, last)
    keys = [
        key
        for key in (export.episodes if export is not None else [])
        if key in _held_by(ledger, lost) and ledger.in_flight(key)
    ]
    restored = False
    if heir is not None and keys and last is not None and export is not None:
        restored = await _restore(
            heir, last.directory / export.directory, ledger, keys, timeout_s, lease_s
        )
    next_keys: list[str] = []
    orphans: list[tuple[str, int]] = []
    async with ledger.mutation():
        for key in keys if restored else []:
            if ledger.in_flight(key):  # still: the restore awaited the heir
                next_keys.append(ledger.next_attempt(key).capture_key)
            else:
                attempt = ledger.attempt(key)
                orphans.append((attempt.rollout_id, attempt.number + 1))
        for attempt in list(ledger.in_state(AttemptState.DISPATCHED)):
            if attempt.host == lost:
                ledger.move(attempt.capture_key, AttemptState.ABANDONED)
        if heir is not None:
            ledger.rehost(lost, heir.name)
    log_event(
        "host_work_moved",
        host=lost,
        heir=heir.name if heir else None,
        restored=len(next_keys),
        checkpoint_id=last.manifest.checkpoint_id if last else None,
    )
    return next_keys, orphans


def _export_of(lost: str, last: LastCheckpoint | None) -> HostExport | None:
    if last is None:
        return None
    return next((host for host in last.manifest.hosts if host.instance == lost), None)


def _held_by(ledger: Ledger, host: str) -> set[str]:
    return {a.capture_key for a in ledger.in_state(AttemptState.DISPATCHED) if a.host == host}


async def _restore(
    heir: RemoteHost,
    directory: Path,
    ledger: Ledger,
    keys: list[str],
    timeout_s: float,
    lease_s: float,
) -> bool:
    """Restore ``keys`` from ``directory`` on ``heir`` and resume it; whether it did. A failure
    is undone on the heir (what it restored is retired) and logged."""
    restore_id = f"recover-{uuid.uuid4().hex[:16]}"
    next_attempts = [
        (attempt.rollout_id, attempt.number + 1) for attempt in map(ledger.attempt, keys)
    ]
    expected = {capture_key(rid, number) for rid, number in next_attempts}
    control = heir.control
    try:
        reply = await control.restore(
            restore_id, str(directory), capture_keys=keys, timeout_s=timeout_s, lease_s=lease_s
        )
        answered = reply.restored
        got = {entry.capture_key for entry in answered}
        if got == expected:
            await control.resume(restore_id, timeout_s=timeout_s)
            return True
        log_event(
            "recovery_failed", host=heir.name, restored=sorted(got), expected=sorted(expected)
        )
    except ControlError as error:
        log_event("recovery_failed", host=heir.name, error=str(error))
    try:
        await control.retire(restore_id, next_attempts, timeout_s=timeout_s)
        await control.resume(restore_id, timeout_s=timeout_s)
    except ControlError as failure:  # its lease resumes it; the ids are never sent
        log_event("recovery_undo_failed", host=heir.name, error=str(failure))
    return False
