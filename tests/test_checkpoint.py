"""The host as a checkpoint participant, on a virtual clock over in-memory streams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.checkpoint_rig import TOKEN, episode, rig, wall
from tests.helpers import (
    URL,
    CountingRunner,
    ScriptedRunner,
    WrittenFromAWorker,
    exchange,
    in_memory,
    request_bytes,
    wire,
)
from trio_gym.config import ServeConfig
from trio_gym.host import Host
from trio_gym.host import checkpoint as checkpoint_module
from trio_gym.host.export import stage_manifest, write_records
from trio_gym.protocol.export import MANIFEST, read_export
from trio_gym.runners import ExampleContext, ExampleRunner
from trio_gym.trainer import RolloutClient, RolloutError
from trio_gym.trainer.control import ControlError, HostControl


async def uninterrupted(example: dict[str, Any]) -> dict[str, Any]:
    result = await ExampleRunner().run_example(example, ExampleContext("solo", 0))
    return result  # type: ignore[no-any-return]


def results_of(rows: list[Any]) -> dict[int, Any]:
    return {row.index: row.result for _, row in rows if not isinstance(row, Exception)}


async def test_prepare_parks_at_boundaries_and_reports_a_long_wait_step_as_a_blocker(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with rig() as r:
        r.stream_in_background(
            "batch", [episode("quick", think_s=10), episode("slow", think_s=1000)]
        )
        await trio.sleep(15)  # quick is in its second step, slow in its first
        first = wire(await r.control.prepare("c1", timeout_s=20, lease_s=3000))
        assert first["phase"] == "preparing" and trio.current_time() == 35
        assert first["blockers"] == {"count": 1, "sample": ["slow"]}
        assert first["parked"] == {"count": 1, "sample": ["quick"]}  # parked at 20 s
        second = wire(await r.control.prepare("c1", timeout_s=2000, lease_s=3000))
        assert second["phase"] == "prepared" and trio.current_time() == 1000
        await trio.sleep(100)  # parked: nothing moves
        assert r.host.services.checkpoints.status().counts.parked == 2
        await r.control.resume("c1", timeout_s=5)
        await r.finish("batch")
    results = results_of(r.rows["batch"])
    assert results[0]["reward"] == (await uninterrupted(episode("quick", think_s=0)))["reward"]
    assert [at for at, row in r.rows["batch"] if row.index == 0] == [1100 + 10]  # one step left
    assert not any(isinstance(row, Exception) for _, row in r.rows["batch"])


async def test_a_replay_step_is_cut_short_and_a_wait_step_is_not(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with rig() as r:
        r.stream_in_background("replay", [episode("r", think_s=1000, step_mode="replay")])
        await trio.sleep(5)
        reply = wire(await r.control.prepare("c1", timeout_s=100))
        assert reply["phase"] == "prepared" and trio.current_time() == 5  # cut at once
        await trio.sleep(50)
        await r.control.resume("c1", timeout_s=5)
        replayed = await r.finish("replay")
    assert [at for at, _ in replayed] == [55 + 3 * 1000]  # the cut step ran again, in full
    assert results_of(replayed)[0]["steps"] == 3
    async with rig() as r:
        start = trio.current_time()
        r.stream_in_background("wait", [episode("w", think_s=1000)])
        await trio.sleep(5)
        reply = wire(await r.control.prepare("c1", timeout_s=100))
        assert reply["phase"] == "preparing" and reply["blockers"]["sample"] == ["w"]
        await r.control.resume("c1", timeout_s=5)
        waited = await r.finish("wait")
    assert [at - start for at, _ in waited] == [3000]  # never cut: the prepare waited on it


async def test_time_parked_is_not_charged_to_the_deadline(autojump_clock: trio.abc.Clock) -> None:
    async with rig(rollout_deadline_s=100) as r:
        # Three steps of 30 s inside a 100 s deadline; parked from 60 s to 300 s.
        r.stream_in_background("batch", [episode("d", think_s=30)])
        await trio.sleep(40)
        await r.control.prepare("c1", timeout_s=60, lease_s=1000)
        await trio.sleep_until(300)
        await r.control.resume("c1", timeout_s=5)
        ((at, row),) = await r.finish("batch")
    assert not isinstance(row, Exception) and row.ok and at == 330


async def test_a_lease_that_expires_resumes_the_host_by_itself(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
) -> None:
    async with rig() as r:
        r.stream_in_background("batch", [episode("e", think_s=10)])
        await trio.sleep(5)
        prepared = wire(await r.control.prepare("c1", timeout_s=20, lease_s=30))
        assert prepared["phase"] == "prepared"
        await r.control.renew("c1", timeout_s=5, lease_s=30)  # at 10 s: now until 40 s
        await trio.sleep(29)
        assert (wire(await r.control.status()))["phase"] == "prepared"
        await trio.sleep(2)
        status = wire(await r.control.status())
        assert status["phase"] == "idle" and status["admission"] == "open"
        with pytest.raises(ControlError) as stale:
            await r.control.commit("c1", "/tmp/never", timeout_s=5)
        assert stale.value.code == "stale_checkpoint"
        rows = await r.finish("batch")
    assert [at for at, _ in rows] == [40 + 20]  # continued at 40 s


async def test_ids_conflict_go_stale_and_completed_calls_replay(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with rig() as r:
        r.stream_in_background("batch", [episode("e", think_s=10)])
        await trio.sleep(1)
        prepared = wire(await r.control.prepare("c1", timeout_s=20))
        assert wire(await r.control.prepare("c1", timeout_s=20)) == prepared
        with pytest.raises(ControlError) as conflict:
            await r.control.prepare("c2", timeout_s=20)
        assert (conflict.value.status, conflict.value.code) == (409, "checkpoint_conflict")
        committed = wire(await r.control.commit("c1", str(tmp_path / "x"), timeout_s=20))
        assert wire(await r.control.commit("c1", str(tmp_path / "x"), timeout_s=20)) == committed
        with pytest.raises(ControlError, match="another directory"):
            await r.control.commit("c1", str(tmp_path / "y"), timeout_s=20)
        resumed = wire(await r.control.resume("c1", timeout_s=5))
        assert wire(await r.control.resume("c1", timeout_s=5)) == resumed
        with pytest.raises(ControlError) as stale:
            await r.control.prepare("c1", timeout_s=20)
        assert stale.value.code == "stale_checkpoint"


async def test_the_control_plane_needs_its_token(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument
) -> None:
    async with rig() as r:
        wrong = HostControl("http://host:1", "guess", opener=r.control._opener, wall_time=wall)
        with pytest.raises(ControlError) as refused:
            await wrong.status()
    assert (refused.value.status, refused.value.code) == (401, "unauthorized")


async def test_commit_exports_digested_records_and_a_manifest(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with rig() as r:
        r.stream_in_background(
            "batch", [episode("a", think_s=10, meetings=4), episode("b", think_s=15)]
        )
        await trio.sleep(12)
        await r.control.prepare("c1", timeout_s=30)
        reply = wire(await r.control.commit("c1", str(tmp_path / "export"), timeout_s=30))
        await r.control.resume("c1", timeout_s=5)
    assert reply["capture_keys"] == ["a", "b"]
    kinds = {p["kind"]: p for p in reply["participants"]}
    assert set(kinds) == {"episodes", "side_effect_store"}
    assert all(p["record_count"] == 2 for p in kinds.values())
    export = read_export(tmp_path / "export")  # every digest and count checks out
    episodes = {e["capture_key"]: e for e in export.records[("host", "episodes")]}
    assert episodes["a"]["step"] == 2 and episodes["b"]["step"] == 1  # parked at 20 s and 15 s
    store = {e["capture_key"]: e for e in export.records[("calendar", "side_effect_store")]}
    assert len(store["a"]["events"]) <= 2


async def test_the_host_runs_on_while_an_export_file_is_written(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    written = WrittenFromAWorker(write_records)
    monkeypatch.setattr(checkpoint_module, "write_records", written)
    async with rig() as r:
        await r.export_one_parked(tmp_path / "export")
    assert read_export(tmp_path / "export").records[("host", "episodes")]
    assert len(written.answered) == 2  # the host's episodes and the calendar's store


async def test_a_resume_while_the_manifest_is_staged_means_it_is_never_published(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The trainer gives up on the checkpoint (resume is also the abort) while the manifest's
    # bytes are fsynced in a worker thread: the parked episodes run on, so the export must not
    # appear, or a restore would run them twice.
    async with rig() as r:

        def stage_during_a_resume(staged: Path, manifest: Any) -> None:
            stage_manifest(staged, manifest)
            trio.from_thread.run_sync(r.host.services.checkpoints.resume, "c1")

        monkeypatch.setattr(checkpoint_module, "stage_manifest", stage_during_a_resume)
        r.stream_in_background("batch", [episode("a", think_s=10)])
        await trio.sleep(12)
        await r.control.prepare("c1", timeout_s=30)
        with pytest.raises(ControlError) as stale:
            await r.control.commit("c1", str(tmp_path / "export"), timeout_s=30)
        assert stale.value.code == "stale_checkpoint"
        assert not (tmp_path / "export" / MANIFEST).exists()
        assert not list((tmp_path / "export").glob(f".{MANIFEST}.*"))  # nothing staged left
        rows = await r.finish("batch")
    assert len(rows) == 1  # the parked episode ran on to its end


async def test_a_tampered_or_unpublished_export_is_refused_and_changes_nothing(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with rig() as r:
        reply = await r.export_one_parked(tmp_path / "export")
    store = next(p for p in reply["participants"] if p["kind"] == "side_effect_store")
    records = Path(store["state_directory"]) / store["records_file"]
    records.write_bytes(records.read_bytes().replace(b'"events"', b'"evenst"'))
    unpublished = tmp_path / "half"
    write_records(
        unpublished, "host", "episodes", [{"capture_key": "a", "state": {}}]
    )  # no manifest
    async with rig() as fresh:
        for directory, fragment in ((tmp_path / "export", "SHA-256"), (unpublished, MANIFEST)):
            with pytest.raises(ControlError) as refused:
                await fresh.control.restore("r1", str(directory), timeout_s=30)
            assert refused.value.code == "export_invalid" and fragment in refused.value.message
        status = wire(await fresh.control.status())
    assert status["phase"] == "idle" and status["counts"]["restored"] == 0
    assert status["admission"] == "open"


async def test_restore_continues_each_episode_once_as_the_next_attempt(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    example = episode("cal", think_s=10, meetings=5)
    async with rig() as a:
        a.stream_in_background("batch", [example])
        await trio.sleep(25)  # in step 3; parks at 30 s, right after its third booking
        await a.control.prepare("c1", timeout_s=30)
        await a.control.commit("c1", str(tmp_path / "export"), timeout_s=30)
        # host A "crashes" here: never resumed, its nursery simply ends
    async with rig() as b:
        restored = wire(await b.control.restore("r1", str(tmp_path / "export"), timeout_s=30))
        assert restored["restored"] == [
            {"rollout_id": "cal", "attempt": 1, "capture_key": "cal-a1", "step": 3}
        ]
        assert (wire(await b.control.status()))["admission"] == "closed"
        again = {**example, "_ng_attempt_index": 1}
        results = await b.client.run([again])  # its own re-dispatch is admitted while closed
        with pytest.raises(RolloutError) as twice:
            await b.client.run([again])
        with pytest.raises(RolloutError) as old:
            await b.client.run([example])
        await b.control.resume("r1", timeout_s=5)
    expected = await uninterrupted(example)
    assert results[0]["reward"] == expected["reward"]
    assert results[0]["booked"] == expected["booked"]  # every booking exactly once
    assert results[0]["_ng_attempt_index"] == 1
    assert twice.value.code == "stale_attempt" and old.value.code == "stale_attempt"
    assert len(b.runner.started) == 1


async def test_admission_closed_refuses_new_work_but_costs_nothing(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
) -> None:
    async with rig() as r:
        r.stream_in_background("running", [episode("old", think_s=10)])
        await trio.sleep(1)
        await r.control.prepare("c1", timeout_s=30)
        with pytest.raises(RolloutError) as refused:
            await r.client.post([episode("new", think_s=1)])
        raw = await exchange(
            await r.client.opener(r.client.endpoint),
            request_bytes({"examples": [episode("raw", think_s=1)]}),
        )
        r.stream_in_background("rows", [episode("new2", think_s=1)])
        await trio.sleep(1)
        await r.control.resume("c1", timeout_s=5)
        after = await r.client.run([episode("new", think_s=1)])
    assert (refused.value.status, refused.value.code) == (409, "admission_closed")
    _, sidecar = r.rows["rows"][0]
    assert sidecar.error.code == "admission_closed"
    assert raw.status == 409 and raw.headers["retry-after"] == "1"
    assert after[0]["_ng_rollout_id"] == "new"
    assert [index for index, _ in r.runner.started].count(0) == 2  # old, then new after resume


async def test_retire_is_refused_during_a_checkpoint_and_stale_until_forget(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
) -> None:
    async with rig() as r:
        r.stream_in_background("batch", [episode("x", think_s=100)])
        await trio.sleep(1)
        await r.control.prepare("c1", timeout_s=5)
        with pytest.raises(ControlError) as open_checkpoint:
            await r.control.retire("t1", [("x", 0)], timeout_s=5)
        await r.control.resume("c1", timeout_s=5)
        retired = wire(await r.control.retire("t1", [("x", 0)], timeout_s=5))
        with pytest.raises(RolloutError) as stale:
            await r.client.run([episode("x", think_s=1)])
        await r.control.forget("f1", ["x"], timeout_s=5)
        again = await r.client.run([episode("x", think_s=1)])
    assert open_checkpoint.value.code == "wrong_phase"
    assert retired["stopped"] == 1 and retired["still_stopping"]["count"] == 0
    ((_, row),) = r.rows["batch"]
    assert row.error.code == "stale_attempt"
    assert stale.value.code == "stale_attempt"
    assert again[0]["steps"] == 3
    assert json.dumps(again)  # plain JSON all the way


async def test_a_restore_with_the_wrong_participants_changes_nothing(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with rig() as r:
        await r.export_one_parked(tmp_path / "export")
    manifest = json.loads((tmp_path / "export" / MANIFEST).read_text())
    manifest["participants"] = [p for p in manifest["participants"] if p["kind"] == "episodes"]
    (tmp_path / "export" / MANIFEST).write_text(json.dumps(manifest))  # the store left out
    async with rig() as fresh:
        with pytest.raises(ControlError) as refused:
            await fresh.control.restore("r1", str(tmp_path / "export"), timeout_s=30)
        status = wire(await fresh.control.status())
    assert refused.value.code == "export_invalid" and "participants" in refused.value.message
    assert status["counts"]["restored"] == 0 and status["admission"] == "open"
    assert len(fresh.runner.inner.store) == 0  # nothing restored into the store either


async def test_episodes_that_cannot_be_captured_are_restarts_never_waited_for_or_exported(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    runner = CountingRunner(ScriptedRunner())  # reports no boundaries: an opaque agent
    host = Host(ServeConfig(port=0, control_token=TOKEN), runner=runner, wall_time=wall)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(host.services.checkpoints.watch_lease)
        opener = in_memory(nursery, host)
        control = HostControl("http://host:1", TOKEN, opener=opener, wall_time=wall)
        client = RolloutClient(URL, opener=opener)
        nursery.start_soon(client.run, [{"sleep_s": 50, "_ng_rollout_id": "opaque"}])
        await trio.sleep(1)
        prepared = wire(await control.prepare("c1", timeout_s=100))
        assert trio.current_time() == 1  # nothing to wait for
        committed = wire(await control.commit("c1", str(tmp_path / "export"), timeout_s=10))
        await control.resume("c1", timeout_s=5)
        await runner.wait_for(lambda r: len(r.completed) == 1)  # it kept running throughout
        nursery.cancel_scope.cancel()
    assert prepared["phase"] == "prepared"
    assert prepared["restarts"] == {"count": 1, "sample": ["opaque"]}
    assert committed["capture_keys"] == []
    assert runner.completed[0][1] == 50  # started at 0 s, never held back
