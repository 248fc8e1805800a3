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

``await coordinator.restore(directory)`` checks everything before changing anything — the live
hosts against the manifest's topology, each export's files against its digests — then restores
on every host; if any host fails, every host retires the restored attempts and resumes. Each
restored episode is then dispatched exactly once, as attempt + 1, on its original host.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio
from pydantic import ValidationError

from trio_gym.errors import WireError, describe_validation_error, raise_unwrapped
from trio_gym.logs import log_event
from trio_gym.protocol.control import HOST_PARTICIPANT, CommitReply
from trio_gym.protocol.export import read_export
from trio_gym.protocol.identity import capture_key
from trio_gym.trainer.control import REPLY_GRACE_S, ControlError
from trio_gym.trainer.dispatch import Dispatcher
from trio_gym.trainer.drain import DrainTimeout, drain
from trio_gym.trainer.ledger import AttemptState, Ledger, LedgerError
from trio_gym.trainer.manifest import (
    MANIFEST_FORMAT,
    CheckpointManifest,
    HostExport,
    ManifestError,
    Participant,
    load_manifest,
    write_manifest,
)

T = TypeVar("T")


class _PicklableError(Exception):
    """An error whose every argument is a string: it pickles as itself (trainers run workers)."""

    def __init__(self, message: str, checkpoint_id: str = "") -> None:
        super().__init__(message, checkpoint_id)
        self.message, self.checkpoint_id = message, checkpoint_id

    def __str__(self) -> str:
        return self.message


class CheckpointUnavailable(_PicklableError):
    """This checkpoint could not be taken now (a host could not park, did not answer, died, or
    its control plane failed); every host was resumed. Try again at the next opportunity."""


class CheckpointAborted(_PicklableError):
    """A mismatch that retrying would hide (ownership, topology, a reply that does not fit the
    ledger), or too many unavailable checkpoints in a row. Nothing was written."""


class RestoreRefused(_PicklableError):
    """The checkpoint does not fit the live hosts or its files; nothing was changed."""


class RestoreFailed(_PicklableError):
    """A host failed to restore; every host retired the restored attempts and resumed."""


@attrs.frozen
class CheckpointSettings:
    control_timeout_s: float = 30.0
    """Each control call's own deadline (it is also bounded by the reply grace)."""
    prepare_timeout_s: float = 120.0
    """How long hosts may take to park every episode at a step boundary."""
    lease_s: float = 60.0
    drain_timeout_s: float = 120.0
    gate_timeout_s: float = 120.0
    """How long closing the gate may wait for submissions under way (their heads)."""
    max_consecutive_failures: int = 3

    def __attrs_post_init__(self) -> None:
        if self.max_consecutive_failures < 1:
            raise ValueError("max_consecutive_failures must be at least 1")


@attrs.frozen
class Restored:
    """What a restore brought back: the trainer's own state as the checkpoint saved it, the
    groups to run again (``run_group`` with their payloads), and the episodes restored."""

    checkpoint_id: str
    trainer_state: dict[str, Any]
    groups: list[str]
    restored: list[str]
    """Capture keys of the restored episodes' next attempts (each dispatched exactly once)."""


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

    # --- checkpoint -------------------------------------------------------------------------

    async def checkpoint(self, directory: Path) -> CheckpointManifest:
        """Take one checkpoint into ``directory`` (created if needed); its manifest."""
        with self._one_at_a_time():
            return await self._checkpoint(directory)

    async def _checkpoint(self, directory: Path) -> CheckpointManifest:
        checkpoint_id = f"ckpt-{uuid.uuid4().hex[:16]}"
        holder = f"checkpoint:{checkpoint_id}"
        directory = _made(directory)
        dispatcher = self.dispatcher
        dispatcher.deadlines.pause(holder)
        try:
            try:
                manifest = await self._take(checkpoint_id, directory)
            finally:  # on every path, cancellation included (the resume is shielded, bounded)
                await self._resume_everywhere(checkpoint_id)
        except (ControlError, DrainTimeout, CheckpointUnavailable) as failure:
            self.consecutive_failures += 1
            reason = f"checkpoint {checkpoint_id} unavailable: {failure}"
            log_event("checkpoint_unavailable", checkpoint_id=checkpoint_id, error=str(failure))
            limit = self.settings.max_consecutive_failures
            if self.consecutive_failures >= limit:
                raise CheckpointAborted(
                    f"{reason} ({self.consecutive_failures} unavailable in a row, "
                    f"max_consecutive_failures={limit})",
                    checkpoint_id,
                ) from failure
            raise CheckpointUnavailable(reason, checkpoint_id) from failure
        finally:
            dispatcher.gate.open()
            dispatcher.deadlines.release(holder)
        self.consecutive_failures = 0
        log_event("checkpoint_taken", checkpoint_id=checkpoint_id, directory=str(directory))
        return manifest

    async def _take(self, checkpoint_id: str, directory: Path) -> CheckpointManifest:
        dispatcher, settings = self.dispatcher, self.settings
        with trio.move_on_after(settings.gate_timeout_s):
            await dispatcher.gate.close()
        if not dispatcher.gate.is_open and dispatcher.gate.admissions_under_way:
            raise CheckpointUnavailable(
                f"{dispatcher.gate.admissions_under_way} dispatch admission(s) (requests "
                f"waiting for their hosts' heads, retires of lost rows) were still under way "
                f"after {settings.gate_timeout_s:g} s (gate_timeout_s)",
                checkpoint_id,
            )
        await self._every_host(dispatcher.retire_queued)
        topology = await self._every_host(lambda host: self._prepare(host, checkpoint_id))
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
            write_manifest(directory, manifest)
        return manifest

    async def _commit_and_drain(
        self, checkpoint_id: str, directory: Path, topology: dict[str, set[tuple[str, str]]]
    ) -> dict[str, HostExport]:
        """Commit every host, check what they exported, then wait for the replies in flight."""
        exports = await self._every_host(
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
        control = self.dispatcher.hosts[host].control
        status = await control.status(timeout_s=self.settings.control_timeout_s)
        reply = await control.prepare(
            checkpoint_id, timeout_s=self.settings.prepare_timeout_s, lease_s=self.settings.lease_s
        )
        if reply.get("phase") != "prepared":
            blockers = reply.get("blockers", {})
            raise CheckpointUnavailable(
                f"{host} could not park every episode within {self.settings.prepare_timeout_s:g} "
                f"s: {blockers.get('count')} still in a step, e.g. {blockers.get('sample')}",
                checkpoint_id,
            )
        named = _participants(status)
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
                await self._every_host(
                    lambda host: self.dispatcher.hosts[host].control.renew(
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
        reply = await self.dispatcher.hosts[host].control.commit(
            checkpoint_id, str(export_directory), timeout_s=self.settings.control_timeout_s
        )
        try:
            parsed = CommitReply.model_validate(reply)
        except ValidationError as exc:
            raise CheckpointAborted(
                f"{host}'s commit reply does not fit the contract: "
                f"{describe_validation_error(exc)}",
                checkpoint_id,
            ) from exc
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

    async def _resume_everywhere(self, checkpoint_id: str) -> None:
        """Resume every host; one that does not answer is logged (its lease resumes it)."""
        timeout = self.settings.control_timeout_s
        await self._every_host_regardless(
            lambda host: self.dispatcher.hosts[host].control.resume(
                checkpoint_id, timeout_s=timeout
            ),
            calls=1,
            event="resume_failed",
        )

    async def _every_host_regardless(
        self, call: Callable[[str], Awaitable[object]], *, calls: int, event: str
    ) -> None:
        """:meth:`_every_host`, on every path: under a shield bounded by ``calls`` control calls
        (each its deadline plus the reply grace), and a failure is logged, never raised — it
        must not replace the error that brought us here."""
        timeout = self.settings.control_timeout_s
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + calls * (timeout + REPLY_GRACE_S) + 1
            try:
                await self._every_host(call)
            except (CheckpointUnavailable, CheckpointAborted) as failure:
                log_event(event, error=str(failure))

    async def _every_host(self, call: Callable[[str], Awaitable[T]]) -> dict[str, T]:
        """``call`` on every host concurrently; its replies by host, or one error naming each
        host that failed (an abort wins over unavailability; bugs propagate as themselves)."""
        replies: dict[str, T] = {}
        failures: dict[str, Exception] = {}

        async def one(host: str) -> None:
            try:
                replies[host] = await call(host)
            except (ControlError, CheckpointUnavailable, CheckpointAborted) as error:
                failures[host] = error

        async with trio.open_nursery() as nursery:
            for host in self.dispatcher.hosts:
                nursery.start_soon(one, host)
        if failures:
            summary = "; ".join(f"{host}: {error}" for host, error in sorted(failures.items()))
            aborts = [e for e in failures.values() if isinstance(e, CheckpointAborted)]
            if aborts:
                raise CheckpointAborted(summary, aborts[0].checkpoint_id)
            raise CheckpointUnavailable(summary)
        return replies

    # --- restore ----------------------------------------------------------------------------

    async def restore(self, directory: Path) -> Restored:
        """Restore the checkpoint in ``directory`` into this (fresh) dispatcher and its hosts."""
        with self._one_at_a_time():
            return await self._restore(directory)

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

    async def _restore(self, directory: Path) -> Restored:
        directory = _absolute(directory)  # hosts read their exports under it
        manifest, ledger = _loaded(directory)
        source = manifest.checkpoint_id
        if self.dispatcher.ledger.groups:
            raise RestoreRefused(
                "restore into a dispatcher that has run nothing: this one's ledger already has "
                f"{len(self.dispatcher.ledger.groups)} group(s)",
                source,
            )
        self._check_files(directory, manifest, ledger)
        statuses = await self._check_live_topology(manifest)
        exports = {host.instance: host for host in manifest.hosts if host.episodes}
        successors = {
            name: [(a.rollout_id, a.number + 1) for a in map(ledger.attempt, export.episodes)]
            for name, export in exports.items()
        }
        restore_id = f"restore-{uuid.uuid4().hex[:16]}"
        try:
            await self._every_host(
                lambda host: self._take_over(host, statuses[host], successors.get(host, []))
            )
        except (CheckpointUnavailable, CheckpointAborted) as failure:
            raise RestoreFailed(
                f"restoring {source}: taking over the hosts failed, nothing was restored: "
                f"{failure}",
                source,
            ) from failure
        try:
            await self._every_host(
                lambda host: self._restore_on(
                    host, restore_id, directory, exports.get(host), successors.get(host, [])
                )
            )
        except (CheckpointUnavailable, CheckpointAborted) as failure:
            await self._undo_restore(restore_id, successors)
            raise RestoreFailed(
                f"restoring {source} failed, every host retired what it restored and resumed: "
                f"{failure}",
                source,
            ) from failure
        await self._resume_everywhere(restore_id)
        restored = []
        async with ledger.mutation():
            for export in exports.values():
                for key in export.episodes:
                    restored.append(ledger.next_attempt(key).capture_key)
            for attempt in list(ledger.in_state(AttemptState.DISPATCHED)):
                ledger.move(attempt.capture_key, AttemptState.ABANDONED)  # never exported
        self.dispatcher.ledger = ledger
        groups = [
            group.group_id
            for group in ledger.groups.values()
            if not group.dropped
            and any(s.current.state is not AttemptState.SEALED for s in group.siblings)
        ]
        log_event("checkpoint_restored", checkpoint_id=source, episodes=len(restored))
        return Restored(source, dict(manifest.trainer_state), groups, restored)

    def _check_files(self, directory: Path, manifest: CheckpointManifest, ledger: Ledger) -> None:
        """The manifest's hosts are this dispatcher's, and each export on disk carries the
        committed digests and the episodes the ledger says it holds."""
        source = manifest.checkpoint_id
        named = {host.instance for host in manifest.hosts}
        if named != set(self.dispatcher.hosts):
            raise RestoreRefused(
                f"checkpoint {source} was taken with hosts {sorted(named)}; this trainer has "
                f"{sorted(self.dispatcher.hosts)}",
                source,
            )
        for host in manifest.hosts:
            try:
                export = read_export(directory / host.directory)
            except WireError as exc:
                raise RestoreRefused(f"{host.instance}: {exc.message}", source) from exc
            on_disk = {
                (p["server_name"], p["kind"]): p["sha256"] for p in export.manifest["participants"]
            }
            committed = {(p.server_name, p.kind): p.sha256 for p in host.participants}
            if on_disk != committed:
                raise RestoreRefused(
                    f"{host.instance}: the export in {host.directory} is not the one committed "
                    f"(on disk {sorted(on_disk.items())}, committed {sorted(committed.items())})",
                    source,
                )
            for key in host.episodes:
                try:
                    attempt = ledger.attempt(key)
                except KeyError:
                    raise RestoreRefused(
                        f"{host.instance} exported {key}, which the ledger does not hold", source
                    ) from None
                if attempt.host != host.instance or attempt.state is not AttemptState.DISPATCHED:
                    raise RestoreRefused(
                        f"{host.instance} exported {key}, which the ledger has "
                        f"{attempt.state.value} on {attempt.host}",
                        source,
                    )

    async def _statuses(self) -> dict[str, dict[str, Any]]:
        timeout = self.settings.control_timeout_s
        return await self._every_host(
            lambda host: self.dispatcher.hosts[host].control.status(timeout_s=timeout)
        )

    async def _check_live_topology(self, manifest: CheckpointManifest) -> dict[str, dict[str, Any]]:
        """Each live host's participants are the manifest's; every host's status."""
        try:
            statuses = await self._statuses()
        except (CheckpointUnavailable, CheckpointAborted) as failure:
            raise RestoreFailed(
                f"restoring {manifest.checkpoint_id}: the hosts' status could not be read, "
                f"nothing was changed: {failure}",
                manifest.checkpoint_id,
            ) from failure
        for host in manifest.hosts:
            live = _participants(statuses[host.instance])
            saved = {(p.server_name, p.kind) for p in host.participants}
            if live != saved:
                raise RestoreRefused(
                    f"{host.instance} now has participants {sorted(live)}; the checkpoint has "
                    f"{sorted(saved)}",
                    manifest.checkpoint_id,
                )
        return statuses

    async def take_over(self) -> None:
        """Make every host idle: resume a checkpoint an earlier trainer process left open (its
        lease would do it, later). A trainer starting without a checkpoint calls this first."""
        statuses = await self._statuses()
        await self._every_host(lambda host: self._take_over(host, statuses[host], []))

    async def _take_over(
        self, host: str, status: dict[str, Any], successors: list[tuple[str, int]]
    ) -> None:
        """Make ``host`` (whose ``status`` was just read) idle and clear what an earlier trainer
        left of these episodes there (a checkpoint it never resumed, an earlier restore of the
        same export)."""
        control = self.dispatcher.hosts[host].control
        timeout = self.settings.control_timeout_s
        if status["phase"] != "idle":
            await control.resume(status["checkpoint_id"], timeout_s=timeout)
        if not successors:
            return
        cleanup = f"takeover-{uuid.uuid4().hex[:16]}"
        await control.retire(cleanup, successors, timeout_s=timeout)
        await control.forget(cleanup, [rid for rid, _ in successors], timeout_s=timeout)

    async def _restore_on(
        self,
        host: str,
        restore_id: str,
        directory: Path,
        export: HostExport | None,
        successors: list[tuple[str, int]],
    ) -> None:
        if export is None:
            return
        reply = await self.dispatcher.hosts[host].control.restore(
            restore_id,
            str(directory / export.directory),
            capture_keys=export.episodes,
            timeout_s=self.settings.control_timeout_s,
            lease_s=self.settings.lease_s,
        )
        expected = {capture_key(rid, attempt) for rid, attempt in successors}
        got = {entry.get("capture_key") for entry in reply.get("restored", [])}
        if got != expected:
            raise CheckpointAborted(
                f"{host} restored {sorted(map(str, got))}, not {sorted(expected)}", restore_id
            )

    async def _undo_restore(
        self, restore_id: str, successors: dict[str, list[tuple[str, int]]]
    ) -> None:
        """Every host retires what it restored (if anything) and resumes."""
        timeout = self.settings.control_timeout_s

        async def undo(host: str) -> None:
            control = self.dispatcher.hosts[host].control
            if successors.get(host):
                await control.retire(restore_id, successors[host], timeout_s=timeout)
            await control.resume(restore_id, timeout_s=timeout)

        await self._every_host_regardless(undo, calls=2, event="restore_undo_failed")


@attrs.define
class _Renewal:
    failure: CheckpointUnavailable | None = None


def _absolute(directory: Path) -> Path:
    return Path(os.path.abspath(directory))


def _made(directory: Path) -> Path:
    """``directory`` made absolute (hosts write their exports under it) and created."""
    directory = _absolute(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _loaded(directory: Path) -> tuple[CheckpointManifest, Ledger]:
    try:
        manifest = load_manifest(directory)
        return manifest, Ledger.from_json(manifest.ledger, incarnation=uuid.uuid4().hex[:8])
    except (ManifestError, LedgerError) as exc:
        raise RestoreRefused(str(exc)) from exc


def _still_owned(export: HostExport, ledger: Ledger) -> HostExport:
    """``export`` without the episodes the ledger gave up since the commit (a group dropped or
    a parked episode's stream cut during the drain): a restore must not bring those back, and
    their attempts are queued to retire."""
    owned = [key for key in export.episodes if ledger.in_flight(key)]
    return export.model_copy(update={"episodes": owned})


def _participants(status: dict[str, Any]) -> set[tuple[str, str]]:
    """The (server name, kind) pairs a host's status lists (none if it lists none)."""
    listed = status.get("participants")
    if not isinstance(listed, list):
        return set()
    return {(str(p.get("server_name")), str(p.get("kind"))) for p in listed if isinstance(p, dict)}
