"""The checkpoint coordinator and restore, on a virtual clock with in-process hosts."""

from __future__ import annotations

import json
import pickle
import shutil
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from tests.fleet import calendar, crash, fleet, restart, uninterrupted
from tests.helpers import ScriptedRunner, WrittenFromAWorker
from trio_gym.trainer import ClientSettings
from trio_gym.trainer import coordinator as coordinator_module
from trio_gym.trainer.control import ControlTimeout, HostControl
from trio_gym.trainer.coordinator import (
    CheckpointAborted,
    CheckpointCoordinator,
    CheckpointSettings,
    CheckpointUnavailable,
    RestoreFailed,
    RestoreRefused,
)
from trio_gym.trainer.dispatch import Dispatcher
from trio_gym.trainer.ledger import AttemptState
from trio_gym.trainer.manifest import MANIFEST_NAME, load_manifest, write_manifest

GROUPS = {
    "long": [calendar(1, think_s=5.0), calendar(2, think_s=5.0)],
    "short": [calendar(3, think_s=1.0, meetings=1), calendar(4, think_s=1.0, meetings=1)],
    "mixed": [calendar(5, think_s=4.0), calendar(6, think_s=0.5, meetings=2)],
}


async def run_all(f: Any, groups: dict[str, list[dict[str, Any]]]) -> None:
    async with trio.open_nursery() as nursery:
        for group_id, examples in groups.items():
            nursery.start_soon(f.dispatcher.run_group, group_id, examples)


async def checkpoint_mid_flight(tmp_path: Path, at: float = 7.0) -> tuple[Any, list[Any]]:
    """Run GROUPS on hosts a and b, checkpoint at ``at`` s; the manifest and all consumed."""
    async with fleet() as f, trio.open_nursery() as nursery:
        nursery.start_soon(run_all, f, GROUPS)
        await trio.sleep(at)
        manifest = await f.coordinator.checkpoint(tmp_path / "c1")
        assert f.dispatcher.gate.is_open and not f.dispatcher.deadlines.holders
        assert all(h.services.checkpoints.status().phase == "idle" for h in f.hosts.values())
    return manifest, f.consumed


def keyed(consumed: list[Any]) -> Counter[tuple[str, int]]:
    return Counter((r["group_id"], r["sibling"]) for r in consumed)


async def test_a_checkpoint_exports_parked_episodes_drains_the_rest_and_resumes(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    manifest, consumed = await checkpoint_mid_flight(tmp_path)
    assert load_manifest(tmp_path / "c1") == manifest
    exported = {key: host.instance for host in manifest.hosts for key in host.episodes}
    assert len(exported) == 3  # long.0, long.1 and mixed.0 were mid-episode
    # The cut: what was consumed then is saved with the ledger that says it was sealed.
    saved = manifest.trainer_state["consumed"]
    assert {(r["group_id"], r["sibling"]) for r in saved} == {
        ("short", 0),
        ("short", 1),
        ("mixed", 1),
    }
    sealed_then = {
        (g["group_id"], s["index"])
        for g in manifest.ledger["groups"]
        for s in g["siblings"]
        if s["attempts"][-1]["state"] == "sealed"
    }
    assert sealed_then == {(r["group_id"], r["sibling"]) for r in saved}
    for host in manifest.hosts:
        assert {(p.server_name, p.kind) for p in host.participants} == {
            ("host", "episodes"),
            ("calendar", "side_effect_store"),
        }
    # After resume every episode finished, and each was consumed exactly once.
    assert len(consumed) == 6 and len({(r.group_id, r.sibling) for r in consumed}) == 6
    for sealed in consumed:
        expected = await uninterrupted(GROUPS[sealed.group_id][sealed.sibling])
        assert sealed.result["booked"] == expected["booked"]


async def test_the_trainer_runs_on_while_its_manifest_is_written(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    written = WrittenFromAWorker(write_manifest)  # while the ledger is locked
    monkeypatch.setattr(coordinator_module, "write_manifest", written)
    await checkpoint_mid_flight(tmp_path)
    assert len(written.answered) == 1
    assert load_manifest(tmp_path / "c1").hosts


async def test_restore_dispatches_each_exported_episode_once_as_the_next_attempt_on_its_host(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    manifest, _ = await checkpoint_mid_flight(tmp_path)
    exported = {key: host.instance for host in manifest.hosts for key in host.episodes}
    async with fleet() as f:  # the trainer restarts; the hosts are new processes
        restored = await f.coordinator.restore(tmp_path / "c1")
        assert sorted(restored.restored) == sorted(f"{key}-a1" for key in exported)
        assert sorted(restored.groups) == ["long", "mixed"]
        await run_all(f, {g: GROUPS[g] for g in restored.groups})
    everything = restored.trainer_state["consumed"] + [
        {"group_id": r.group_id, "sibling": r.sibling} for r in f.consumed
    ]
    assert keyed(everything) == Counter({(g, i): 1 for g in GROUPS for i in range(2)})
    for sealed in f.consumed:
        key = sealed.rollout_id
        assert sealed.attempt == 1 and exported[key] == sealed.host  # attempt + 1, same host
        assert sealed.result["_ng_attempt_index"] == 1
        expected = await uninterrupted(GROUPS[sealed.group_id][sealed.sibling])
        assert sealed.result["booked"] == expected["booked"]  # side effects exactly once
        assert sealed.result["reward"] == expected["reward"]
    assert sum(len(r.started) for r in f.runners.values()) == len(exported)


async def test_a_checkpoint_moved_elsewhere_restores_from_where_it_is_now(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    manifest, _ = await checkpoint_mid_flight(tmp_path)
    exported = {key for host in manifest.hosts for key in host.episodes}
    for host in manifest.hosts:  # every path is the checkpoint's own, relative to it
        assert host.directory == f"hosts/{host.instance}"
        assert all(p.state_directory.startswith(f"{host.directory}/") for p in host.participants)
    moved = tmp_path / "other-storage" / "c1"
    moved.parent.mkdir()
    shutil.move(tmp_path / "c1", moved)  # as a trainer copies its checkpoints away
    async with fleet() as f:
        restored = await f.coordinator.restore(moved)
        await run_all(f, {g: GROUPS[g] for g in restored.groups})
    assert sorted(restored.restored) == sorted(f"{key}-a1" for key in exported)
    assert len(f.consumed) == len(exported)


@pytest.mark.parametrize("where", ["absolute", "escaping"])
async def test_a_manifest_pointing_outside_its_checkpoint_is_refused_before_any_host_changes(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
    tmp_path: Path,
    where: str,
) -> None:
    await checkpoint_mid_flight(tmp_path)
    path = tmp_path / "c1" / "gym_checkpoint.json"
    document = json.loads(path.read_text())
    host = document["hosts"][0]
    host["directory"] = str(tmp_path / "c1" / host["directory"]) if where == "absolute" else "../c0"
    path.write_text(json.dumps(document))
    async with fleet() as f:
        with pytest.raises(RestoreRefused, match="not a path inside the checkpoint"):
            await f.coordinator.restore(tmp_path / "c1")
        assert all(h.services.checkpoints.status().counts.restored == 0 for h in f.hosts.values())


@pytest.mark.parametrize(
    ("successors", "refusal"),
    [
        (
            None,
            r"taken with hosts \['a', 'b'\]; \['b'\] are not among this trainer's hosts "
            r"\['a', 'c'\]: name the host that takes each one's place",
        ),
        ({"b": "d"}, r"'d' is not one of this trainer's hosts"),
        ({"b": "a"}, r"'a' is a host of the checkpoint and restores its own episodes"),
        ({"a": "c"}, r"'a' is one of this trainer's hosts and restores its own episodes"),
        ({"x": "c"}, r"the checkpoint has no host 'x'"),
    ],
)
async def test_a_restore_that_does_not_fit_the_live_hosts_changes_nothing(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
    tmp_path: Path,
    successors: dict[str, str] | None,
    refusal: str,
) -> None:
    await checkpoint_mid_flight(tmp_path)
    async with fleet(("a", "c")) as f:
        with pytest.raises(RestoreRefused, match=refusal):
            await f.coordinator.restore(tmp_path / "c1", successors=successors)
        assert all(h.services.checkpoints.status().counts.restored == 0 for h in f.hosts.values())
        assert not f.dispatcher.ledger.groups


async def test_a_host_that_left_has_its_episodes_restored_on_its_named_successor(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    manifest, _ = await checkpoint_mid_flight(tmp_path)
    exported = {key: host.instance for host in manifest.hosts for key in host.episodes}
    assert set(exported.values()) == {"a", "b"}
    # b left the pool; c took its place, and d is new capacity the checkpoint never knew.
    async with fleet(("a", "c", "d")) as f:
        restored = await f.coordinator.restore(tmp_path / "c1", successors={"b": "c"})
        assert sorted(restored.restored) == sorted(f"{key}-a1" for key in exported)
        await run_all(f, {g: GROUPS[g] for g in restored.groups})
    everything = restored.trainer_state["consumed"] + [
        {"group_id": r.group_id, "sibling": r.sibling} for r in f.consumed
    ]
    assert keyed(everything) == Counter({(g, i): 1 for g in GROUPS for i in range(2)})
    moved = {"a": "a", "b": "c"}
    for sealed in f.consumed:
        assert sealed.attempt == 1 and sealed.host == moved[exported[sealed.rollout_id]]
        expected = await uninterrupted(GROUPS[sealed.group_id][sealed.sibling])
        assert sealed.result["booked"] == expected["booked"]  # b's side effects, on c, once
    assert not f.runners["d"].started


async def test_a_tampered_export_is_refused_before_any_host_changes(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    manifest, _ = await checkpoint_mid_flight(tmp_path)
    host = manifest.hosts[0]
    calendar_part = next(p for p in host.participants if p.kind == "side_effect_store")
    records = tmp_path / "c1" / calendar_part.state_directory
    (records / calendar_part.records_file).write_text('{"capture_key": "forged"}\n')
    async with fleet() as f:
        with pytest.raises(RestoreRefused, match="SHA-256"):
            await f.coordinator.restore(tmp_path / "c1")
        assert all(h.services.checkpoints.status().counts.restored == 0 for h in f.hosts.values())


async def test_an_export_swapped_for_another_commit_is_refused(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    manifest, _ = await checkpoint_mid_flight(tmp_path)
    document = json.loads((tmp_path / "c1" / MANIFEST_NAME).read_text())
    document["hosts"][0]["participants"][0]["sha256"] = "0" * 64  # not what is on disk
    (tmp_path / "c1" / MANIFEST_NAME).write_text(json.dumps(document))
    async with fleet() as f:
        with pytest.raises(RestoreRefused, match="is not the one committed"):
            await f.coordinator.restore(tmp_path / "c1")
        assert all(h.services.checkpoints.status().counts.restored == 0 for h in f.hosts.values())


class DiesDuringRestore(HostControl):
    async def restore(self, *args: Any, **kwargs: Any) -> Any:
        raise ControlTimeout("restore: no reply (the host died)", code="timeout", status=0)


async def test_a_failed_restore_on_one_host_is_undone_on_every_host(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    await checkpoint_mid_flight(tmp_path)
    async with fleet(controls={"b": DiesDuringRestore}) as f:
        with pytest.raises(RestoreFailed, match="b: restore: no reply") as failed:
            await f.coordinator.restore(tmp_path / "c1")
        statuses = {name: h.services.checkpoints.status() for name, h in f.hosts.items()}
        assert not f.dispatcher.ledger.groups  # the trainer took nothing in
    assert "every host retired what it restored and resumed" in str(failed.value)
    for status in statuses.values():
        assert (status.phase, status.admission) == ("idle", "open")
        assert status.counts.restored == 0
    assert statuses["a"].counts.retired >= 1  # a had restored its episodes: retired


async def test_an_episode_the_trainer_never_dispatched_aborts_the_checkpoint(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with fleet() as f:
        stranger = f.dispatcher.hosts["a"].client.stream(
            [{**calendar(9, think_s=5), "_ng_rollout_id": "not-ours"}]
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_all, f, {"long": GROUPS["long"]})

            async def outsider() -> None:
                async with stranger as rows:
                    async for _ in rows:
                        pass

            nursery.start_soon(outsider)
            await trio.sleep(7)
            with pytest.raises(CheckpointAborted, match="not-ours, which this trainer never"):
                await f.coordinator.checkpoint(tmp_path / "c1")
            assert f.dispatcher.gate.is_open
            assert all(h.services.checkpoints.status().phase == "idle" for h in f.hosts.values())
    assert not (tmp_path / "c1" / MANIFEST_NAME).exists()
    assert len(f.consumed) == 2  # the trainer's own work went on


async def test_a_host_that_cannot_park_makes_the_checkpoint_unavailable_then_aborted(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    settings = CheckpointSettings(prepare_timeout_s=20, max_consecutive_failures=2)
    async with fleet(checkpoint=settings) as f, trio.open_nursery() as nursery:
        nursery.start_soon(run_all, f, {"slow": [calendar(1, think_s=1000)]})
        await trio.sleep(5)
        with pytest.raises(CheckpointUnavailable, match="could not park") as first:
            await f.coordinator.checkpoint(tmp_path / "c1")
        assert all(h.services.checkpoints.status().phase == "idle" for h in f.hosts.values())
        assert f.dispatcher.gate.is_open and not f.dispatcher.deadlines.holders
        with pytest.raises(CheckpointAborted, match="2 unavailable in a row"):
            await f.coordinator.checkpoint(tmp_path / "c2")
        nursery.cancel_scope.cancel()
    took = f.dispatcher.scheduler.stats.checkpoint_seconds
    assert {outcome: h.count for outcome, h in took.items()} == {"unavailable": 1, "aborted": 1}
    assert took["unavailable"].total >= settings.prepare_timeout_s  # it waited to park, in vain
    again = pickle.loads(pickle.dumps(first.value))
    assert type(again) is CheckpointUnavailable and str(again) == str(first.value)
    assert again.checkpoint_id == first.value.checkpoint_id


async def test_an_unavailable_checkpoint_is_retried_and_the_count_resets(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    settings = CheckpointSettings(prepare_timeout_s=20, max_consecutive_failures=2)
    async with fleet(checkpoint=settings) as f, trio.open_nursery() as nursery:
        nursery.start_soon(run_all, f, {"slow": [calendar(1, think_s=30, meetings=2)]})
        await trio.sleep(5)
        with pytest.raises(CheckpointUnavailable):
            await f.coordinator.checkpoint(tmp_path / "c1")  # in a 30 s step until 30
        await trio.sleep(2)  # the next opportunity: parks at the boundary at 60
        manifest = await f.coordinator.checkpoint(tmp_path / "c2")
        assert f.coordinator.consecutive_failures == 0
        took = f.dispatcher.scheduler.stats.checkpoint_seconds
        assert {outcome: h.count for outcome, h in took.items()} == {"unavailable": 1, "taken": 1}
    assert [host.episodes for host in manifest.hosts if host.episodes]
    assert f.dispatcher.ledger.groups["slow"].siblings[0].current.state is AttemptState.SEALED


async def test_request_deadlines_stand_still_while_a_checkpoint_holds_admission_closed(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    settings = CheckpointSettings(prepare_timeout_s=500)
    client = ClientSettings(request_deadline_s=40)
    async with fleet(client=client, checkpoint=settings) as f, trio.open_nursery() as nursery:
        # "quick" (3 steps of 10 s) parks at 10; "slow" holds the prepare until its step ends.
        nursery.start_soon(f.dispatcher.run_group, "quick", [calendar(1, think_s=10)])
        nursery.start_soon(f.dispatcher.run_group, "slow", [calendar(2, think_s=100, meetings=1)])
        await trio.sleep(5)
        await f.coordinator.checkpoint(tmp_path / "c1")
        assert trio.current_time() >= 100  # far past the 40 s request deadline
    ledger = f.dispatcher.ledger
    for group in ("quick", "slow"):
        (attempt,) = ledger.groups[group].siblings[0].attempts  # never cut, never re-sent
        assert attempt.state is AttemptState.SEALED


class TamperedCommit(HostControl):
    """A host whose commit reply does not fit what it should have exported."""

    def __init__(self, *args: Any, tamper: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tamper = tamper

    async def _exchange(self, operation: Any, request: Any, timeout_s: float) -> Any:
        reply = await super()._exchange(operation, request, timeout_s)
        if operation.name != "commit":
            return reply
        participants = reply["participants"]
        if self.tamper == "unexpected participant":
            participants.append({**participants[-1], "server_name": "stranger"})
        elif self.tamper == "participant not committed":
            participants.pop()
        elif self.tamper == "malformed":
            participants[0] = "oops"
        elif self.tamper == "two owners":
            reply["capture_keys"] = [*reply["capture_keys"], self.other_host_key]
            for participant in participants:
                participant["capture_keys"] = reply["capture_keys"]
        return reply

    other_host_key = ""


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        ("unexpected participant", r"unexpected \['stranger/side_effect_store'\]"),
        ("participant not committed", r"not committed \['calendar/side_effect_store'\]"),
        ("two owners", "was exported by both"),
        ("malformed", "commit reply does not fit the contract"),
    ],
)
async def test_a_commit_reply_that_does_not_fit_aborts_the_checkpoint(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
    tmp_path: Path,
    tamper: str,
    message: str,
) -> None:
    controls = {"b": partial(TamperedCommit, tamper=tamper)}
    async with fleet(controls=controls) as f, trio.open_nursery() as nursery:
        tampered = f.dispatcher.hosts["b"].control
        assert isinstance(tampered, TamperedCommit)
        nursery.start_soon(run_all, f, {"long": GROUPS["long"]})
        await trio.sleep(7)
        tampered.other_host_key = next(
            a.capture_key
            for a in f.dispatcher.ledger.in_state(AttemptState.DISPATCHED)
            if a.host == "a"
        )
        with pytest.raises(CheckpointAborted, match=message):
            await f.coordinator.checkpoint(tmp_path / "c1")
        assert all(h.services.checkpoints.status().phase == "idle" for h in f.hosts.values())
        assert f.dispatcher.gate.is_open
    assert not (tmp_path / "c1" / MANIFEST_NAME).exists()
    assert len(f.consumed) == 2


async def test_a_trainer_after_a_crash_never_reuses_the_ids_of_work_a_host_still_runs(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    late = {"late": [calendar(7, think_s=100)]}  # created after the checkpoint, long-running
    async with fleet() as f:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_all, f, GROUPS)
            await trio.sleep(7)
            await f.coordinator.checkpoint(tmp_path / "c1")
            nursery.start_soon(run_all, f, late)
            await trio.sleep(1)
            crash(f)
            nursery.cancel_scope.cancel()
        restart(f)
        # Restored, it sends "late" again, and crashes the same way; restored once more, it
        # sends "late" a third time while the hosts still run both earlier copies.
        consumed: list[Any] = []
        for finish in (False, True):
            dispatcher = Dispatcher(list(f.dispatcher.hosts.values()), consumed.append)
            restored = await CheckpointCoordinator(dispatcher).restore(tmp_path / "c1")
            groups = {**{g: GROUPS[g] for g in restored.groups}, **late}
            async with dispatcher:
                if finish:
                    with trio.fail_after(10_000):
                        await run_all(_As(dispatcher), groups)
                    break
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_all, _As(dispatcher), groups)
                    await trio.sleep(1)
                    crash(f)
                    nursery.cancel_scope.cancel()
                restart(f)
            consumed.clear()
        outcomes = consumed
    (late_attempt,) = dispatcher.ledger.groups["late"].siblings[0].attempts
    assert late_attempt.state is AttemptState.SEALED  # an id of its own: no collision, no loss
    assert outcomes and all(sealed.error is None for sealed in outcomes), [
        sealed.error for sealed in outcomes if sealed.error
    ]


@attrs.frozen
class _As:
    """What ``run_all`` needs of a fleet: its dispatcher."""

    dispatcher: Dispatcher


async def test_an_episode_given_up_during_the_drain_is_left_out_of_the_manifest(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    scripted = {"b": ScriptedRunner()}  # b's episodes report no boundaries: drained
    async with fleet(runners=scripted) as f, trio.open_nursery() as nursery:
        parked_scope = trio.CancelScope()
        nursery.start_soon(_run_in, parked_scope, f, "parked", [calendar(1, think_s=5)])
        drained = partial(f.dispatcher.run_group, hosts=["b"])
        nursery.start_soon(drained, "drained", [{"sleep_s": 50}])
        await trio.sleep(7)

        async def give_up_during_the_drain() -> None:
            await trio.sleep(13)  # the checkpoint is draining "drained" until 50
            parked_scope.cancel()

        nursery.start_soon(give_up_during_the_drain)
        manifest = await f.coordinator.checkpoint(tmp_path / "c1")
        parked = f.dispatcher.ledger.groups["parked"].siblings[0].current
    assert parked.state is AttemptState.ABANDONED
    assert [host.episodes for host in manifest.hosts] == [[], []]
    assert (parked.rollout_id, 0) in f.dispatcher.to_retire["a"]
    async with fleet(runners={"b": ScriptedRunner()}) as again:
        restored = await again.coordinator.restore(tmp_path / "c1")
    assert restored.groups == [] and restored.restored == []  # the dropped group stays dropped


async def _run_in(scope: trio.CancelScope, f: Any, group_id: str, examples: Any) -> None:
    with scope:
        await f.dispatcher.run_group(group_id, examples, hosts=["a"])


async def test_a_second_checkpoint_while_one_is_under_way_is_refused(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with fleet() as f, trio.open_nursery() as nursery:
        nursery.start_soon(run_all, f, {"slow": [calendar(1, think_s=50, meetings=1)]})
        await trio.sleep(1)
        nursery.start_soon(f.coordinator.checkpoint, tmp_path / "c1")  # parks at 50
        await trio.sleep(5)
        with pytest.raises(RuntimeError, match="already under way"):
            await f.coordinator.checkpoint(tmp_path / "c2")
        with pytest.raises(RuntimeError, match="already under way"):
            await f.coordinator.restore(tmp_path / "c0")
    assert (tmp_path / "c1" / MANIFEST_NAME).exists() and not (tmp_path / "c2").exists()
