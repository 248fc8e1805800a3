"""The host as a checkpoint participant: the operations, their id rules and replies, and the
lease. (A batch's deadline stands still while its episodes are parked: that is the episodes'.)

The phases and their legal moves are :mod:`~trio_gym.host.checkpoint_phases`; reading an export
back is :mod:`~trio_gym.host.restore`. Every call names a ``checkpoint_id``. While one is
active, another id is ``checkpoint_conflict``; an id already resumed is ``stale_checkpoint``;
an operation that completed replays its reply. ``prepare`` closes admission and waits — on the
episode registry's changes, never by polling — until every capturable episode is parked at a
step boundary, or its deadline; ``preparing`` replies name the blockers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

import attrs
import trio

from trio_gym.changes import Changes
from trio_gym.errors import ErrorCode, WireError
from trio_gym.files import fsync_directory
from trio_gym.logs import log_event
from trio_gym.protocol.control import (
    HOST_PARTICIPANT,
    MAX_LEASE_S,
    CheckpointPhase,
    CommitReply,
    Counts,
    ForgetReply,
    ParticipantName,
    PrepareReply,
    RenewReply,
    Reply,
    RestoredEpisodeName,
    RestoreReply,
    ResumeReply,
    RetireReply,
    RetireRollout,
    Sample,
    StatusReply,
)
from trio_gym.protocol.export import FORMAT, ParticipantExport
from trio_gym.runners.base import StateParticipant

from .checkpoint_phases import CheckpointPhases
from .episodes import Episodes, LiveEpisode
from .export import publish_manifest, stage_manifest, staging_path, write_records
from .restore import host_record, plan_restore

SAMPLE: Final = 16  # blockers and restarts listed by name in a reply; the count is always whole
REMEMBERED_IDS: Final = 4096  # resumed ids kept to refuse them as stale; older ones are forgotten

R = TypeVar("R", bound=Reply)


def _sample(keys: Iterable[str]) -> Sample:
    keys = sorted(keys)
    return Sample(count=len(keys), sample=keys[:SAMPLE])


@attrs.frozen
class _Done:
    request: object
    """What made the reply: a replay needs the same (``None`` where any call replays)."""
    reply: Reply


class ReplyCache:
    """The replies of completed operations of the active checkpoint, to replay them."""

    def __init__(self) -> None:
        self._done: dict[tuple[str, str], _Done] = {}

    def replay(
        self, kind: type[R], operation: str, checkpoint_id: str, request: object, conflict: str
    ) -> R | None:
        """The reply of a completed identical call, or ``None``; a call under the same id with
        a different ``request`` is ``checkpoint_conflict`` with the ``conflict`` message."""
        done = self._done.get((operation, checkpoint_id))
        if done is None:
            return None
        if done.request != request:
            raise WireError(ErrorCode.CHECKPOINT_CONFLICT, conflict)
        assert isinstance(done.reply, kind)
        return done.reply

    def remember(self, operation: str, checkpoint_id: str, request: object, reply: Reply) -> None:
        self._done[(operation, checkpoint_id)] = _Done(request, reply)

    def forget_checkpoint(self, checkpoint_id: str) -> None:
        """Only the resume is remembered of a finished checkpoint."""
        for key in [key for key in self._done if key[1] == checkpoint_id]:
            del self._done[key]


class Checkpoints:
    """The checkpoint participant of one host process: its episodes (which own the phases),
    and the runner's state, when the runner keeps some (``participant``)."""

    def __init__(
        self,
        *,
        participant: Callable[[], StateParticipant | None],
        runner_reports_boundaries: Callable[[], bool],
        wall_time: Callable[[], float],
    ) -> None:
        self.episodes = Episodes(runner_reports_boundaries=runner_reports_boundaries)
        self._participant = participant
        self._wall_time = wall_time
        self.lease_until: float | None = None
        self._replies = ReplyCache()
        self._resumed: OrderedDict[str, ResumeReply] = OrderedDict()
        self._export: trio.CancelScope | None = None
        self._lease_changes = Changes()
        self._committing: set[str] = set()

    @property
    def phases(self) -> CheckpointPhases:
        """The episodes' phases (they own them and follow their moves)."""
        return self.episodes.phases

    @property
    def phase(self) -> CheckpointPhase:
        return self.phases.phase

    @property
    def checkpoint_id(self) -> str | None:
        return self.phases.checkpoint_id

    # --- time ---------------------------------------------------------------------------

    def trio_deadline(self, wall_deadline: float) -> float:
        """An absolute wall-clock deadline (seconds since the epoch) on trio's clock."""
        return trio.current_time() + (wall_deadline - self._wall_time())

    def wall(self, trio_time: float) -> float:
        return self._wall_time() + (trio_time - trio.current_time())

    def _set_lease(self, lease_s: float) -> None:
        self.lease_until = trio.current_time() + lease_s
        self._lease_changes.note()

    async def watch_lease(self) -> None:
        """Resume the host when a lease runs out unrenewed. Runs for the server's lifetime."""
        while True:
            if self.lease_until is None:
                await self._lease_changes.wait()
                continue
            with trio.move_on_at(self.lease_until):
                await self._lease_changes.wait()
                continue
            if self.checkpoint_id is not None:
                log_event("lease_expired", checkpoint_id=self.checkpoint_id)
                self._resume(self.checkpoint_id)

    # --- the id rules -------------------------------------------------------------------

    def _check_id(self, checkpoint_id: str) -> None:
        self._check_not_stale(checkpoint_id)
        self._check_no_conflict(checkpoint_id)

    def _check_not_stale(self, checkpoint_id: str) -> None:
        if checkpoint_id in self._resumed:
            raise WireError(
                ErrorCode.STALE_CHECKPOINT,
                f"checkpoint {checkpoint_id} was already resumed; start a new one with a new id",
            )

    def _check_no_conflict(self, checkpoint_id: str) -> None:
        if self.checkpoint_id is not None and checkpoint_id != self.checkpoint_id:
            raise WireError(
                ErrorCode.CHECKPOINT_CONFLICT,
                f"checkpoint {self.checkpoint_id} is {self.phase.value}; resume it before "
                f"{checkpoint_id}",
            )

    def _wrong_phase(self, operation: str, needs: str) -> WireError:
        return WireError(
            ErrorCode.WRONG_PHASE,
            f"{operation} needs the host {needs}; it is {self.phase.value}"
            + (f" (checkpoint {self.checkpoint_id})" if self.checkpoint_id else ""),
        )

    def _participants(self) -> list[tuple[str, str]]:
        """This host's participants as (server name, kind): itself, and its runner's store."""
        participant = self._participant()
        return [HOST_PARTICIPANT, *([participant.participant] if participant else [])]

    # --- operations ---------------------------------------------------------------------

    def status(self) -> StatusReply:
        parked = len(self.episodes.parked())
        return StatusReply(
            phase=self.phase,
            participants=[
                ParticipantName(server_name=name, kind=kind) for name, kind in self._participants()
            ],
            checkpoint_id=self.checkpoint_id,
            admission="open" if self.episodes.admission_open else "closed",
            lease_expires_at=self.wall(self.lease_until) if self.lease_until else None,
            counts=Counts(
                running=len(self.episodes.live) - parked,
                parked=parked,
                restored=len(self.episodes.restored),
                retired=len(self.episodes.retired),
            ),
        )

    async def prepare(self, checkpoint_id: str, deadline: float, lease_s: float) -> PrepareReply:
        self._check_id(checkpoint_id)
        if replay := self._replies.replay(PrepareReply, "prepare", checkpoint_id, None, ""):
            return replay
        if self.phase is CheckpointPhase.IDLE:
            self.phases.move(CheckpointPhase.PREPARING, checkpoint_id)
            log_event("checkpoint_preparing", checkpoint_id=checkpoint_id)
        elif self.phase is not CheckpointPhase.PREPARING:
            raise self._wrong_phase("prepare", "idle")
        call_deadline = self.trio_deadline(deadline)
        # A caller waiting on this call is alive: the lease runs from the call's deadline
        # (within the same cap as a lease, so a far deadline cannot make it endless).
        waiting = min(max(call_deadline - trio.current_time(), 0), MAX_LEASE_S)
        self._set_lease(waiting + lease_s)
        with trio.move_on_at(call_deadline):
            while self.episodes.blockers() and self.phase is CheckpointPhase.PREPARING:
                await self.episodes.wait_for_change()
        if self.checkpoint_id != checkpoint_id:  # resumed (or lease lost) while waiting
            raise WireError(
                ErrorCode.STALE_CHECKPOINT, f"checkpoint {checkpoint_id} was resumed meanwhile"
            )
        blockers = [live.id.capture_key for live in self.episodes.blockers()]
        if not blockers and self.phase is CheckpointPhase.PREPARING:  # not if a twin call did
            self.phases.move(CheckpointPhase.PREPARED, checkpoint_id)
        reply = PrepareReply(
            phase=self.phase,
            checkpoint_id=checkpoint_id,
            admission="closed",
            parked=_sample(live.id.capture_key for live in self.episodes.parked()),
            blockers=_sample(blockers),
            restarts=_sample(live.id.capture_key for live in self.episodes.restarts()),
            lease_expires_at=self.wall(self.lease_until or 0),
        )
        if not blockers:
            self._replies.remember("prepare", checkpoint_id, None, reply)
            log_event(
                "checkpoint_prepared",
                checkpoint_id=checkpoint_id,
                parked=reply.parked.model_dump(),
            )
        return reply

    def renew(self, checkpoint_id: str, lease_s: float) -> RenewReply:
        self._check_id(checkpoint_id)
        if self.checkpoint_id is None:
            raise self._wrong_phase("renew", "in a checkpoint")
        self._set_lease(lease_s)
        return RenewReply(
            phase=self.phase,
            checkpoint_id=checkpoint_id,
            lease_expires_at=self.wall(self.lease_until or 0),
        )

    async def commit(
        self,
        checkpoint_id: str,
        deadline: float,
        directory: Path,
        capture_keys: Sequence[str] | None,
    ) -> CommitReply:
        self._check_id(checkpoint_id)
        scope = (str(directory), tuple(sorted(capture_keys)) if capture_keys is not None else None)
        conflict = f"checkpoint {checkpoint_id} was committed to another directory or scope"
        if replay := self._replies.replay(CommitReply, "commit", checkpoint_id, scope, conflict):
            return replay
        if checkpoint_id in self._committing:
            raise WireError(
                ErrorCode.CHECKPOINT_CONFLICT,
                f"checkpoint {checkpoint_id} is being committed by an earlier call; retry for "
                "its reply",
            )
        if self.phase is not CheckpointPhase.PREPARED:
            raise self._wrong_phase("commit", "prepared")
        if capture_keys is not None and len(set(capture_keys)) != len(capture_keys):
            raise WireError(ErrorCode.INVALID_REQUEST, "capture_keys lists a key twice")
        if self.episodes.blockers():
            raise self._wrong_phase("commit", "prepared with every episode parked")
        parked = {live.id.capture_key: live for live in self.episodes.parked()}
        keys = sorted(parked) if capture_keys is None else sorted(capture_keys)
        missing = [key for key in keys if key not in parked]
        if missing:
            raise WireError(
                ErrorCode.CHECKPOINT_CONFLICT,
                f"{len(missing)} capture key(s) in scope are not parked here: {missing[:SAMPLE]}",
            )
        episodes = [parked[key] for key in keys]
        participant = self._participant()
        records = [(*HOST_PARTICIPANT, [host_record(live) for live in episodes])]
        if participant is not None:
            records.append((*participant.participant, participant.export_records(keys)))
        # Each file is written and fsynced in a worker thread (the heartbeats go on meanwhile);
        # a file once begun is finished (the thread is not abandoned), so the deadline or a
        # resume takes effect between files. The manifest is staged there too, and published
        # here on the trio thread, where no resume can come between the check and the link.
        self._committing.add(checkpoint_id)
        try:
            with trio.move_on_at(self.trio_deadline(deadline)) as export:
                self._export = export
                exports = []
                for server_name, kind, rows in records:
                    exports.append(
                        await trio.to_thread.run_sync(
                            write_records, directory, server_name, kind, rows
                        )
                    )
                manifest = _manifest(checkpoint_id, exports, episodes)
                staged = staging_path(directory)  # named here: removed however the call ends
                try:
                    await trio.to_thread.run_sync(stage_manifest, staged, manifest)
                    if self.checkpoint_id == checkpoint_id and not export.cancel_called:
                        path = publish_manifest(directory, staged)
                finally:
                    staged.unlink(missing_ok=True)
                # A resume while this runs finds the export published, as one after any commit
                # would: harmless, for a trainer writes no manifest of an aborted checkpoint.
                await trio.to_thread.run_sync(fsync_directory, directory)
        finally:
            self._export = None
            self._committing.discard(checkpoint_id)
        if self.checkpoint_id != checkpoint_id:
            raise WireError(
                ErrorCode.STALE_CHECKPOINT,
                f"checkpoint {checkpoint_id} was resumed before its export was published",
            )
        if export.cancelled_caught:
            raise WireError(
                ErrorCode.DEADLINE_EXCEEDED, "the export did not finish before the call's deadline"
            )
        self.phases.move(CheckpointPhase.COMMITTED, checkpoint_id)
        reply = CommitReply.model_validate(
            {
                "phase": CheckpointPhase.COMMITTED,
                "checkpoint_id": checkpoint_id,
                "directory": str(directory),
                "manifest": str(path),
                "participants": [export.to_json() for export in exports],
                "capture_keys": keys,
            }
        )
        self._replies.remember("commit", checkpoint_id, scope, reply)
        log_event("checkpoint_committed", checkpoint_id=checkpoint_id, episodes=len(keys))
        return reply

    def resume(self, checkpoint_id: str) -> ResumeReply:
        """Reopen admission and release parked episodes. Idempotent; it is also the abort."""
        if replay := self._resumed.get(checkpoint_id):
            return replay
        if self.checkpoint_id is not None and checkpoint_id != self.checkpoint_id:
            raise WireError(
                ErrorCode.CHECKPOINT_CONFLICT,
                f"checkpoint {self.checkpoint_id} is active; {checkpoint_id} is not it",
            )
        return self._resume(checkpoint_id)

    def _resume(self, checkpoint_id: str) -> ResumeReply:
        if self._export is not None:
            self._export.cancel()  # an unfinished export must never publish
        self.phases.move(CheckpointPhase.IDLE, checkpoint_id)
        self._replies.forget_checkpoint(checkpoint_id)
        self.lease_until = None
        self._lease_changes.note()
        reply = ResumeReply(
            phase=CheckpointPhase.IDLE, checkpoint_id=checkpoint_id, admission="open"
        )
        self._resumed[checkpoint_id] = reply
        while len(self._resumed) > REMEMBERED_IDS:
            self._resumed.popitem(last=False)
        log_event("checkpoint_resumed", checkpoint_id=checkpoint_id)
        return reply

    def restore(
        self,
        checkpoint_id: str,
        directory: Path,
        capture_keys: Sequence[str] | None,
        lease_s: float,
    ) -> RestoreReply:
        self._check_id(checkpoint_id)
        if replay := self._replies.replay(RestoreReply, "restore", checkpoint_id, None, ""):
            return replay
        if self.phase is not CheckpointPhase.IDLE:
            raise self._wrong_phase("restore", "idle")
        participant = self._participant()
        # Planned (read and checked) and installed on the trio thread with no await: nothing
        # else can change the phase in between.
        plan = plan_restore(
            directory,
            capture_keys,
            participants=self._participants(),
            runner_participant=participant.participant if participant is not None else None,
            episodes=self.episodes,
        )
        if participant is not None:
            participant.restore_records(plan.participant_records, plan.renames)
        self.episodes.install(plan.episodes)
        self.phases.move(CheckpointPhase.RESTORED, checkpoint_id)
        self._set_lease(lease_s)
        reply = RestoreReply(
            phase=CheckpointPhase.RESTORED,
            checkpoint_id=checkpoint_id,
            admission="closed",
            source_checkpoint_id=plan.source_checkpoint_id,
            restored=[
                RestoredEpisodeName(
                    rollout_id=episode.id.rollout_id,
                    attempt=episode.id.attempt,
                    capture_key=episode.id.capture_key,
                    step=episode.step,
                )
                for episode in plan.episodes
            ],
        )
        self._replies.remember("restore", checkpoint_id, None, reply)
        log_event("checkpoint_restored", checkpoint_id=checkpoint_id, episodes=len(plan.episodes))
        return reply

    def _check_idle_or_restored(self, operation: str, checkpoint_id: str) -> None:
        """retire and forget run only outside an open checkpoint; while restored, under the
        restore's id (a trainer retires what a failed restore left, then resumes)."""
        if self.phase not in (CheckpointPhase.IDLE, CheckpointPhase.RESTORED):
            raise self._wrong_phase(operation, "idle or restored (not while a checkpoint is open)")
        self._check_no_conflict(checkpoint_id)

    @staticmethod
    def _other_arguments(operation: str, checkpoint_id: str) -> str:
        return f"{operation} {checkpoint_id} was already done with other arguments; use a new id"

    async def retire(
        self, checkpoint_id: str, deadline: float, rollouts: Sequence[tuple[str, int]]
    ) -> RetireReply:
        request = sorted(rollouts)
        self._check_not_stale(checkpoint_id)
        conflict = self._other_arguments("retire", checkpoint_id)
        if replay := self._replies.replay(RetireReply, "retire", checkpoint_id, request, conflict):
            return replay
        self._check_idle_or_restored("retire", checkpoint_id)
        stopping: list[LiveEpisode] = []
        participant = self._participant()
        for rollout_id, attempt in rollouts:
            cancelled, dropped = self.episodes.retire(rollout_id, attempt)
            stopping.extend(cancelled)
            for key in dropped:
                if participant is not None:
                    participant.discard(key)
        with trio.move_on_at(self.trio_deadline(deadline)):
            while any(self.episodes.live.get(live.id.capture_key) is live for live in stopping):
                await self.episodes.wait_for_change()
        still = [
            live.id.capture_key
            for live in stopping
            if self.episodes.live.get(live.id.capture_key) is live
        ]
        reply = RetireReply(
            checkpoint_id=checkpoint_id,
            complete=not still,
            retired=[RetireRollout(rollout_id=rid, attempt=attempt) for rid, attempt in rollouts],
            stopped=len(stopping) - len(still),
            still_stopping=_sample(still),
        )
        if not still:
            self._replies.remember("retire", checkpoint_id, request, reply)
        return reply

    def forget(self, checkpoint_id: str, rollout_ids: Sequence[str] | None) -> ForgetReply:
        request = sorted(rollout_ids) if rollout_ids is not None else None
        self._check_not_stale(checkpoint_id)
        conflict = self._other_arguments("forget", checkpoint_id)
        if replay := self._replies.replay(ForgetReply, "forget", checkpoint_id, request, conflict):
            return replay
        self._check_idle_or_restored("forget", checkpoint_id)
        reply = ForgetReply(
            checkpoint_id=checkpoint_id, forgotten=self.episodes.forget(rollout_ids)
        )
        self._replies.remember("forget", checkpoint_id, request, reply)
        return reply


def _manifest(
    checkpoint_id: str, exports: Sequence[ParticipantExport], episodes: Sequence[LiveEpisode]
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "checkpoint_id": checkpoint_id,
        "participants": [export.to_json() for export in exports],
        "episodes": [
            {
                "capture_key": live.id.capture_key,
                "rollout_id": live.id.rollout_id,
                "attempt": live.id.attempt,
                "step": live.step,
            }
            for live in episodes
        ],
    }
