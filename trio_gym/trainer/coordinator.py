"""The checkpoint coordinator: one consistent cut of the trainer and every host, and its restore.

``await coordinator.checkpoint(directory)`` runs, in this order:

1. close the dispatch gate (waits for submissions under way) and pause request deadlines;
2. retire attempts the ledger gave up that a host may still run (before prepare: hosts are idle);
3. prepare every host concurrently (admission closes, episodes park at step boundaries);
4. keep renewing the hosts' leases while
5. every host commits its export to ``directory/hosts/<name>`` (ownership and topology are
   checked against the ledger and the hosts' participants), and
6. the drain waits for the replies already in flight (episodes that finished instead of parking);
7. write ``gym_checkpoint.json`` atomically, last: the ledger and the trainer's state as one cut;
8. resume every host, reopen the gate, release the deadlines.

A checkpoint that could not park, went unanswered, found a dead host or a failing control plane
raises :class:`CheckpointUnavailable` after resuming every host: the trainer carries on and tries
again at its next opportunity; after ``max_consecutive_failures`` in a row it is
:class:`CheckpointAborted`. Ownership, topology and reply mismatches abort at once (retrying would
hide them). Both errors survive pickling.

``await coordinator.restore(directory)`` and ``await coordinator.take_over()`` are the
:class:`~trio_gym.trainer.restore.Restorer`'s (``restore.py``), one at a time with checkpoints.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from trio_gym.errors import raise_unwrapped
from trio_gym.logs import log_event
from trio_gym.protocol.control import (
    HOST_PARTICIPANT,
    CheckpointPhase,
)
from trio_gym.trainer.checkpointing import (
    CheckpointAborted,
    CheckpointSettings,
    CheckpointUnavailable,
    EveryHost,
    RestoreFailed,
    RestoreRefused,
    absolute,
    fitting,
)
from trio_gym.trainer.control import ControlError
from trio_gym.trainer.dispatch import Dispatcher
from trio_gym.trainer.drain import DrainTimeout, drain
from trio_gym.trainer.ledger import AttemptState, Ledger
from trio_gym.trainer.manifest import (
    MANIFEST_FORMAT,
    CheckpointManifest,
    HostExport,
    Participant,
    write_manifest,
)
from trio_gym.trainer.recovery import LastCheckpoint
from trio_gym.trainer.restore import Restored, Restorer

__all__ = [
    "CheckpointAborted",
    "CheckpointCoordinator",
    "CheckpointSettings",
    "CheckpointUnavailable",
    "RestoreFailed",
    "RestoreRefused",
    "Restored",
]


class CheckpointCoordinator:
    """Takes checkpoints of a :class:`Dispatcher`'s hosts and ledger, and restores them.

    ``trainer_state`` returns what the trainer must save in the same cut (what it has consumed);
    it is called inside the ledger's mutation that snapshots the ledger, so no result can be
    sealed between the two.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        settings: CheckpointSettings | None = None,
        trainer_state: Callable[[], Mapping[str, Any]] = dict,
    ) -> None:
        self.dispatcher = dispatcher
        self.settings = settings or CheckpointSettings()
        self.trainer_state = trainer_state
        self.consecutive_failures = 0
        self._busy = False
        self._hosts = EveryHost(dispatcher, self.settings)
        self._restorer = Restorer(self._hosts)

    # --- checkpoint -------------------------------------------------------------------------

    async def checkpoint(self, directory: Path) -> CheckpointManifest:
        """Take one checkpoint into ``directory`` (created if needed); its manifest."""
        with self._one_at_a_time():
            # A lost host's work reaches its heir first (its replacement may be starting).
            with trio.move_on_after(self.settings.gate_timeout_s):
                await self.dispatcher.scheduler.until_handed_on()
            async with self.dispatcher.host_changes:  # no lost host's recovery meanwhile
                return await self._checkpoint(directory)

    async def _checkpoint(self, directory: Path) -> CheckpointManifest:
        checkpoint_id = f"ckpt-{uuid.uuid4().hex[:16]}"
        holder = f"checkpoint:{checkpoint_id}"
        directory = _made(directory)
        dispatcher = self.dispatcher
        dispatcher.deadlines.pause(holder)
        started, outcome = trio.current_time(), "failed"  # cancelled, or a bug
        try:
            try:
                manifest = await self._take(checkpoint_id, directory)
            finally:  # on every path, cancellation included (the resume is shielded, bounded)
                await self._hosts.resume(checkpoint_id)
            outcome = "taken"
        except (ControlError, DrainTimeout, CheckpointUnavailable) as failure:
            outcome = "unavailable"
            self.consecutive_failures += 1
            reason = f"checkpoint {checkpoint_id} unavailable: {failure}"
            log_event("checkpoint_unavailable", checkpoint_id=checkpoint_id, error=str(failure))
            limit = self.settings.max_consecutive_failures
            if self.consecutive_failures >= limit:
                outcome = "aborted"
                raise CheckpointAborted(
                    f"{reason} ({self.consecutive_failures} unavailable in a row, "
                    f"max_consecutive_failures={limit})",
                    checkpoint_id,
                ) from failure
            raise CheckpointUnavailable(reason, checkpoint_id) from failure
        finally:
            dispatcher.gate.open()
            dispatcher.deadlines.release(holder)
            stats = dispatcher.scheduler.stats
            stats.checkpoint_took(outcome, trio.current_time() - started)
        self.consecutive_failures = 0
        log_event("checkpoint_taken", checkpoint_id=checkpoint_id, directory=str(directory))
        return manifest

    async def _take(self, checkpoint_id: str, directory: Path) -> CheckpointManifest:
        dispatcher, settings = self.dispatcher, self.settings
        if unsettled := dispatcher.scheduler.unsettled:
            raise CheckpointUnavailable(
                f"hosts {unsettled} were lost and their work was not on their heirs within "
                f"{self.settings.gate_timeout_s:g} s (gate_timeout_s: a replacement is starting)",
                checkpoint_id,
            )
        with trio.move_on_after(settings.gate_timeout_s):
            await dispatcher.gate.close()
        if not dispatcher.gate.is_open and dispatcher.gate.admissions_under_way:
            raise CheckpointUnavailable(
                f"{dispatcher.gate.admissions_under_way} dispatch admission(s) (requests "
                f"waiting for their hosts' heads, retires of lost rows) were still under way "
                f"after {settings.gate_timeout_s:g} s (gate_timeout_s)",
                checkpoint_id,
            )
        await self._hosts.call(dispatcher.retire_queued)
        topology = await self._hosts.call(lambda host: self._prepare(host, checkpoint_id))
        renewal = _Renewal()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._renew_leases, checkpoint_id, renewal, nursery.cancel_scope)
                exports = await self._commit_and_drain(checkpoint_id, directory, topology)
                nursery.cancel_scope.cancel()
        except ExceptionGroup as group:  # the renewal task never raises: the body's error
            raise_unwrapped(group)
        if renewal.failure is not None:
            raise renewal.failure
        async with dispatcher.ledger.mutation() as ledger:
            manifest = CheckpointManifest(
                format=MANIFEST_FORMAT,
                checkpoint_id=checkpoint_id,
                ledger=ledger.to_json(),
                trainer_state=dict(self.trainer_state()),
                hosts=[_still_owned(exports[host], ledger) for host in sorted(exports)],
            )
            await trio.to_thread.run_sync(write_manifest, directory, manifest)
        dispatcher.last_checkpoint = LastCheckpoint(directory, manifest)
        return manifest

    async def _commit_and_drain(
        self, checkpoint_id: str, directory: Path, topology: dict[str, set[tuple[str, str]]]
    ) -> dict[str, HostExport]:
        """Commit every host, check what they exported, then wait for the replies in flight."""
        exports = await self._hosts.call(
            lambda host: self._commit(host, checkpoint_id, directory, topology[host])
        )
        exported = self._check_ownership(checkpoint_id, exports)
        ledger = self.dispatcher.ledger
        in_flight = [
            attempt.capture_key
            for attempt in ledger.in_state(AttemptState.DISPATCHED)
            if attempt.capture_key not in exported
        ]
        await drain(ledger, in_flight, self.settings.drain_timeout_s)
        return exports

    async def _prepare(self, host: str, checkpoint_id: str) -> set[tuple[str, str]]:
        """Prepare ``host``; its participants (from its status, read first)."""
        control = self._hosts.control(host)
        status = await fitting(
            control.status(timeout_s=self.settings.control_timeout_s), checkpoint_id
        )
        prepared = await fitting(
            control.prepare(
                checkpoint_id,
                timeout_s=self.settings.prepare_timeout_s,
                lease_s=self.settings.lease_s,
            ),
            checkpoint_id,
        )
        if prepared.phase is not CheckpointPhase.PREPARED:
            blockers = prepared.blockers
            raise CheckpointUnavailable(
                f"{host} could not park every episode within {self.settings.prepare_timeout_s:g} "
                f"s: {blockers.count} still in a step, e.g. {blockers.sample}",
                checkpoint_id,
            )
        named = {(p.server_name, p.kind) for p in status.participants}
        if not named:
            raise CheckpointAborted(
                f"{host} lists no participants in its status (a host older than this trainer?)",
                checkpoint_id,
            )
        return named

    async def _renew_leases(
        self, checkpoint_id: str, renewal: _Renewal, scope: trio.CancelScope
    ) -> None:
        """Renew every host's lease at a third of its length; a failure ends the checkpoint."""
        lease = self.settings.lease_s
        timeout = min(self.settings.control_timeout_s, lease / 3)
        while True:
            await trio.sleep(lease / 3)
            try:
                await self._hosts.call(
                    lambda host: self._hosts.control(host).renew(
                        checkpoint_id, timeout_s=timeout, lease_s=lease
                    )
                )
            except (ControlError, CheckpointUnavailable) as failure:
                renewal.failure = CheckpointUnavailable(
                    f"a lease renewal failed: {failure}", checkpoint_id
                )
                scope.cancel()
                return

    async def _commit(
        self, host: str, checkpoint_id: str, directory: Path, participants: set[tuple[str, str]]
    ) -> HostExport:
        export_directory = directory / "hosts" / host
        parsed = await fitting(
            self._hosts.control(host).commit(
                checkpoint_id, str(export_directory), timeout_s=self.settings.control_timeout_s
            ),
            checkpoint_id,
        )
        keys = set(parsed.capture_keys)
        named = {(p.server_name, p.kind) for p in parsed.participants}
        if named != participants:
            surplus = sorted("/".join(p) for p in named - participants)
            absent = sorted("/".join(p) for p in participants - named)
            raise CheckpointAborted(
                f"{host} committed participants that are not its topology: unexpected {surplus}, "
                f"not committed {absent}",
                checkpoint_id,
            )
        for entry in parsed.participants:
            covered = set(entry.capture_keys)
            owner = (entry.server_name, entry.kind) == HOST_PARTICIPANT
            if (owner and covered != keys) or not covered <= keys:
                raise CheckpointAborted(
                    f"{host}: participant {entry.server_name}/{entry.kind} covers "
                    f"{sorted(covered)}, the export is {sorted(keys)}",
                    checkpoint_id,
                )
        parts = []
        for entry in parsed.participants:
            state = Path(entry.state_directory)
            if not state.is_relative_to(directory):
                raise CheckpointAborted(
                    f"{host} put {entry.server_name}/{entry.kind}'s state in {state}, outside "
                    f"the checkpoint {directory}",
                    checkpoint_id,
                )
            fields = entry.model_dump(exclude={"capture_keys", "state_directory"})
            relative = state.relative_to(directory).as_posix()
            parts.append(Participant.model_validate({**fields, "state_directory": relative}))
        return HostExport(
            instance=host,
            directory=export_directory.relative_to(directory).as_posix(),
            episodes=sorted(keys),
            participants=parts,
        )

    def _check_ownership(self, checkpoint_id: str, exports: dict[str, HostExport]) -> set[str]:
        """Every exported episode is one the ledger has dispatched to that host and not yet
        settled, or one it lost meanwhile and queued to retire (the manifest leaves those out:
        :func:`_still_owned`). Returns every exported key."""
        dispatcher = self.dispatcher
        ledger = dispatcher.ledger
        owners: dict[str, str] = {}
        for host in sorted(exports):
            for key in exports[host].episodes:
                if key in owners:
                    raise CheckpointAborted(
                        f"episode {key} was exported by both {owners[key]} and {host}",
                        checkpoint_id,
                    )
                owners[key] = host
        for host, export in exports.items():
            for key in export.episodes:
                try:
                    attempt, current = ledger.attempt(key), ledger.sibling_of(key).current
                except KeyError:
                    raise CheckpointAborted(
                        f"{host} exported episode {key}, which this trainer never dispatched "
                        "(outside the checkpoint's scope)",
                        checkpoint_id,
                    ) from None
                lost = (attempt.rollout_id, attempt.number) in dispatcher.to_retire[host]
                if attempt.state is AttemptState.ABANDONED and lost:
                    continue
                if attempt.state is AttemptState.RESERVED and attempt.host == host:
                    # Its request's head never came (not taken, by the one rule), yet the host
                    # holds it: left out, retired; its re-send is then a loss, run afresh.
                    dispatcher.queue_retire(attempt)
                    continue
                if attempt.host != host or current is not attempt:
                    raise CheckpointAborted(
                        f"{host} exported episode {key}, which the ledger places on "
                        f"{attempt.host} ({'current' if current is attempt else 'superseded'})",
                        checkpoint_id,
                    )
                if attempt.state is not AttemptState.DISPATCHED:
                    raise CheckpointAborted(
                        f"{host} exported episode {key}, which the ledger has "
                        f"{attempt.state.value}",
                        checkpoint_id,
                    )
        return set(owners)

    # --- restore ----------------------------------------------------------------------------

    async def restore(
        self, directory: Path, *, successors: Mapping[str, str] | None = None
    ) -> Restored:
        """Restore the checkpoint in ``directory`` into this (fresh) dispatcher and its hosts;
        ``successors`` names the host that takes the place of each of the checkpoint's hosts
        that left (see :meth:`Restorer.restore`)."""
        with self._one_at_a_time():
            return await self._restorer.restore(directory, successors)

    async def take_over(self) -> None:
        """Make every host idle: resume a checkpoint an earlier trainer process left open (its
        lease would do it, later). A trainer starting without a checkpoint calls this first."""
        await self._restorer.take_over()

    @contextlib.contextmanager
    def _one_at_a_time(self) -> Iterator[None]:
        """A checkpoint or a restore at a time: two at once is a trainer bug, not a condition
        to retry."""
        if self._busy:
            raise RuntimeError("a checkpoint or restore is already under way; await it first")
        self._busy = True
        try:
            yield
        finally:
            self._busy = False


@attrs.define
class _Renewal:
    failure: CheckpointUnavailable | None = None


def _made(directory: Path) -> Path:
    """``directory`` made absolute (hosts write their exports under it) and created."""
    directory = absolute(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _still_owned(export: HostExport, ledger: Ledger) -> HostExport:
    """``export`` without the episodes the ledger gave up since the commit (a group dropped or
    a parked episode's stream cut during the drain): a restore must not bring those back, and
    their attempts are queued to retire."""
    owned = [key for key in export.episodes if ledger.in_flight(key)]
    return export.model_copy(update={"episodes": owned})
