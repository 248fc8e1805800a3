"""Restoring a checkpoint into a fresh dispatcher and its hosts, and taking hosts over.

``await restorer.restore(directory)`` checks everything before changing anything — the live
hosts against the manifest's topology, each export's files against its digests — then restores
on every host; if any host fails, every host retires the restored attempts and resumes. Each
restored episode is then dispatched exactly once, as attempt + 1, on its original host.
:class:`~trio_gym.trainer.coordinator.CheckpointCoordinator` owns a :class:`Restorer` and is
what a trainer calls.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from trio_gym.errors import WireError
from trio_gym.logs import log_event
from trio_gym.protocol.control import CheckpointPhase, StatusReply
from trio_gym.protocol.export import read_export
from trio_gym.protocol.identity import capture_key
from trio_gym.trainer.checkpointing import (
    CheckpointAborted,
    CheckpointUnavailable,
    EveryHost,
    RestoreFailed,
    RestoreRefused,
    absolute,
    fitting,
)
from trio_gym.trainer.ledger import AttemptState, Ledger, LedgerError
from trio_gym.trainer.manifest import CheckpointManifest, HostExport, ManifestError, load_manifest


@attrs.frozen
class Restored:
    """What a restore brought back: the trainer's own state as the checkpoint saved it, the
    groups to run again (``run_group`` with their payloads), and the episodes restored."""

    checkpoint_id: str
    trainer_state: dict[str, Any]
    groups: list[str]
    restored: list[str]
    """Capture keys of the restored episodes' next attempts (each dispatched exactly once)."""


class Restorer:
    """Restores checkpoints into the dispatcher behind ``hosts``, which must have run nothing."""

    def __init__(self, hosts: EveryHost) -> None:
        self.hosts = hosts
        self.dispatcher, self.settings = hosts.dispatcher, hosts.settings

    async def restore(
        self, directory: Path, successors: Mapping[str, str] | None = None
    ) -> Restored:
        """Restore the checkpoint in ``directory`` into this (fresh) dispatcher and its hosts.

        Each host of the checkpoint restores its own episodes; one that is not among this
        trainer's hosts any more (it left the pool) must be named in ``successors`` with the
        host that takes its place (``{"old": "new"}``, ``new`` a host the checkpoint does not
        have): ``new`` restores ``old``'s export, and ``old``'s unfinished work is ``new``'s
        from then on. Hosts the checkpoint does not name take none of its episodes.
        """
        directory = absolute(directory)
        manifest, ledger = _loaded(directory)
        source = manifest.checkpoint_id
        if self.dispatcher.ledger.groups:
            raise RestoreRefused(
                "restore into a dispatcher that has run nothing: this one's ledger already has "
                f"{len(self.dispatcher.ledger.groups)} group(s)",
                source,
            )
        place = self._placement(manifest, dict(successors or {}))
        self._check_files(directory, manifest, ledger)
        statuses = await self._check_live_topology(manifest, place)
        exports = {place[host.instance]: host for host in manifest.hosts if host.episodes}
        next_attempts = {
            name: [(a.rollout_id, a.number + 1) for a in map(ledger.attempt, export.episodes)]
            for name, export in exports.items()
        }
        restore_id = f"restore-{uuid.uuid4().hex[:16]}"
        try:
            await self.hosts.call(
                lambda host: self._take_over(host, statuses[host], next_attempts.get(host, []))
            )
        except (CheckpointUnavailable, CheckpointAborted) as failure:
            raise RestoreFailed(
                f"restoring {source}: taking over the hosts failed, nothing was restored: "
                f"{failure}",
                source,
            ) from failure
        try:
            await self.hosts.call(
                lambda host: self._restore_on(
                    host, restore_id, directory, exports.get(host), next_attempts.get(host, [])
                )
            )
        except (CheckpointUnavailable, CheckpointAborted) as failure:
            await self._undo_restore(restore_id, next_attempts)
            raise RestoreFailed(
                f"restoring {source} failed, every host retired what it restored and resumed: "
                f"{failure}",
                source,
            ) from failure
        await self.hosts.resume(restore_id)
        restored = []
        async with ledger.mutation():
            for old, new in place.items():
                if old != new:
                    ledger.rehost(old, new)
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

    def _placement(
        self, manifest: CheckpointManifest, successors: dict[str, str]
    ) -> dict[str, str]:
        """Where each of the checkpoint's hosts restores: itself, or its named successor.
        Raises :class:`RestoreRefused` for a host with neither, and for a map that does not
        fit (a successor the checkpoint has, or two hosts sharing one)."""
        source = manifest.checkpoint_id
        named = [host.instance for host in manifest.hosts]
        live = set(self.dispatcher.hosts)
        for old, new in successors.items():
            if old not in named:
                why = f"the checkpoint has no host {old!r} (it has {sorted(named)})"
            elif old in live:
                why = f"{old!r} is one of this trainer's hosts and restores its own episodes"
            elif new not in live:
                why = f"{new!r} is not one of this trainer's hosts {sorted(live)}"
            elif new in named:
                why = f"{new!r} is a host of the checkpoint and restores its own episodes"
            else:
                continue
            raise RestoreRefused(f"successors {{{old!r}: {new!r}}}: {why}", source)
        if len(set(successors.values())) != len(successors):
            raise RestoreRefused(
                f"successors {successors}: each host that left needs a successor of its own",
                source,
            )
        missing = [name for name in named if name not in live and name not in successors]
        if missing:
            raise RestoreRefused(
                f"checkpoint {source} was taken with hosts {sorted(named)}; {missing} are not "
                f"among this trainer's hosts {sorted(live)}: name the host that takes each one's "
                f"place, restore(directory, successors={{{missing[0]!r}: ...}})",
                source,
            )
        return {name: successors.get(name, name) for name in named}

    def _check_files(self, directory: Path, manifest: CheckpointManifest, ledger: Ledger) -> None:
        """Each export on disk carries the committed digests and the episodes the ledger says
        it holds."""
        source = manifest.checkpoint_id
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

    async def _statuses(self) -> dict[str, StatusReply]:
        timeout = self.settings.control_timeout_s

        async def status(host: str) -> StatusReply:
            return await fitting(self.hosts.control(host).status(timeout_s=timeout), "")

        return await self.hosts.call(status)

    async def _check_live_topology(
        self, manifest: CheckpointManifest, place: Mapping[str, str]
    ) -> dict[str, StatusReply]:
        """The participants of the live host each of the manifest's restores on are the
        manifest's; every host's status."""
        try:
            statuses = await self._statuses()
        except (CheckpointUnavailable, CheckpointAborted) as failure:
            raise RestoreFailed(
                f"restoring {manifest.checkpoint_id}: the hosts' status could not be read, "
                f"nothing was changed: {failure}",
                manifest.checkpoint_id,
            ) from failure
        for host in manifest.hosts:
            there = place[host.instance]
            live = {(p.server_name, p.kind) for p in statuses[there].participants}
            saved = {(p.server_name, p.kind) for p in host.participants}
            if live != saved:
                raise RestoreRefused(
                    f"{there} now has participants {sorted(live)}; the checkpoint has "
                    f"{sorted(saved)} for {host.instance}",
                    manifest.checkpoint_id,
                )
        return statuses

    async def take_over(self) -> None:
        """Make every host idle: resume a checkpoint an earlier trainer process left open (its
        lease would do it, later). A trainer starting without a checkpoint calls this first."""
        statuses = await self._statuses()
        await self.hosts.call(lambda host: self._take_over(host, statuses[host], []))

    async def _take_over(
        self, host: str, status: StatusReply, next_attempts: list[tuple[str, int]]
    ) -> None:
        """Make ``host`` (whose ``status`` was just read) idle and clear what an earlier trainer
        left of these episodes there (a checkpoint it never resumed, an earlier restore of the
        same export)."""
        control = self.hosts.control(host)
        timeout = self.settings.control_timeout_s
        left_open = _left_open(host, status)
        if left_open is not None:
            await control.resume(left_open, timeout_s=timeout)
        if not next_attempts:
            return
        cleanup = f"takeover-{uuid.uuid4().hex[:16]}"
        await control.retire(cleanup, next_attempts, timeout_s=timeout)
        await control.forget(cleanup, [rid for rid, _ in next_attempts], timeout_s=timeout)

    async def _restore_on(
        self,
        host: str,
        restore_id: str,
        directory: Path,
        export: HostExport | None,
        next_attempts: list[tuple[str, int]],
    ) -> None:
        if export is None:
            return
        reply = await fitting(
            self.hosts.control(host).restore(
                restore_id,
                str(directory / export.directory),
                capture_keys=export.episodes,
                timeout_s=self.settings.control_timeout_s,
                lease_s=self.settings.lease_s,
            ),
            restore_id,
        )
        expected = {capture_key(rid, attempt) for rid, attempt in next_attempts}
        restored = reply.restored
        got = {entry.capture_key for entry in restored}
        if got != expected:
            raise CheckpointAborted(
                f"{host} restored {sorted(got)}, not {sorted(expected)}", restore_id
            )

    async def _undo_restore(
        self, restore_id: str, next_attempts: dict[str, list[tuple[str, int]]]
    ) -> None:
        """Every host retires what it restored (if anything) and resumes."""
        timeout = self.settings.control_timeout_s

        async def undo(host: str) -> None:
            control = self.hosts.control(host)
            if next_attempts.get(host):
                await control.retire(restore_id, next_attempts[host], timeout_s=timeout)
            await control.resume(restore_id, timeout_s=timeout)

        await self.hosts.call_regardless(undo, calls=2, event="restore_undo_failed")


def _loaded(directory: Path) -> tuple[CheckpointManifest, Ledger]:
    try:
        manifest = load_manifest(directory)
        return manifest, Ledger.from_json(manifest.ledger, incarnation=uuid.uuid4().hex[:8])
    except (ManifestError, LedgerError) as exc:
        raise RestoreRefused(str(exc)) from exc


def _left_open(host: str, status: StatusReply) -> str | None:
    """The checkpoint ``host`` is in by its ``status``, None if it is idle. A host in a
    checkpoint that names none does not fit the contract: there is nothing to resume."""
    if status.phase is CheckpointPhase.IDLE:
        return None
    if status.checkpoint_id is None:
        raise CheckpointAborted(
            f"{host}'s status reply does not fit the contract: phase {status.phase} names no "
            "checkpoint_id"
        )
    return status.checkpoint_id
