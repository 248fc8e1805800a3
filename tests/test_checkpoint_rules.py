"""The checkpoint control plane's rules one by one: ids, scopes, exports, retire and forget.

Every test here was written against a rule that a mutation of ``host/checkpoint.py``,
``host/episodes.py`` or ``protocol/export.py`` would break (``scripts/mutations.py``).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.checkpoint_rig import TOKEN, episode, rig, wall
from tests.helpers import exchange, in_memory, request_bytes, wire
from trio_gym.config import ServeConfig
from trio_gym.errors import WireError
from trio_gym.host import Host
from trio_gym.host.control import CARRY_OUT
from trio_gym.host.server import ROUTES
from trio_gym.protocol.control import OPERATIONS, STATUS
from trio_gym.protocol.export import MANIFEST
from trio_gym.runners import ExampleRunner
from trio_gym.trainer import RolloutError
from trio_gym.trainer.control import ControlError, ControlTimeout, HostControl


async def exported(tmp_path: Path, *rollout_ids: str) -> Path:
    """An export of ``rollout_ids``, each parked at its step-2 boundary by a host since gone."""
    directory = tmp_path / "export"
    async with rig() as a:
        a.stream_in_background(
            "batch", [episode(rid, think_s=10, meetings=4) for rid in rollout_ids]
        )
        await trio.sleep(15)
        await a.control.prepare("c1", timeout_s=30)
        await a.control.commit("c1", str(directory), timeout_s=30)
    return directory


def rewrite_records(directory: Path, kind: str, change: Any) -> None:
    """Replace one participant's records with ``change(records)``, re-digested and recounted
    in the manifest, so only the rule under test can refuse the export."""
    manifest = json.loads((directory / MANIFEST).read_text())
    entry = next(p for p in manifest["participants"] if p["kind"] == kind)
    folder = directory / "participants" / kind / entry["server_name"]
    records = [
        json.loads(line) for line in (folder / entry["records_file"]).read_bytes().splitlines()
    ]
    data = b"".join(json.dumps(record).encode() + b"\n" for record in change(records))
    digest = hashlib.sha256(data).hexdigest()
    (folder / f"{digest}.jsonl").write_bytes(data)
    entry.update(records_file=f"{digest}.jsonl", sha256=digest, record_count=len(change(records)))
    (directory / MANIFEST).write_text(json.dumps(manifest))


def rewrite_manifest(directory: Path, change: Any) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    change(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest))


async def raw_post(opener: Any, path: str, body: dict[str, Any], token: str | None) -> Any:
    headers = [("authorization", f"Bearer {token}")] if token else []
    return await exchange(await opener(None), request_bytes(body, target=path, headers=headers))


# --- the plane's gate ---------------------------------------------------------------------


async def test_every_operation_needs_the_token_and_the_plane_is_off_without_one(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
) -> None:
    body = {"checkpoint_id": "c1", "deadline": wall() + 10}
    async with rig() as r:
        opener = r.client.opener
        without = await raw_post(opener, "/control/v1/checkpoint/prepare", body, None)
        wrong = await raw_post(opener, "/control/v1/checkpoint/prepare", body, "guess")
        status = wire(await r.control.status())
    assert (without.status, wrong.status) == (401, 401)
    assert status["phase"] == "idle" and status["admission"] == "open"  # nothing was prepared

    host = Host(ServeConfig(port=0), runner=ExampleRunner(), wall_time=wall)
    async with trio.open_nursery() as nursery:
        opener = in_memory(nursery, host)
        off = await raw_post(opener, "/control/v1/checkpoint/prepare", body, "anything")
        nursery.cancel_scope.cancel()
    assert off.status == 404
    assert host.services.episodes.admission_open


async def test_a_lease_longer_than_an_hour_is_refused(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument
) -> None:
    async with rig() as r:
        with pytest.raises(ControlError) as refused:
            await r.control.prepare("c1", timeout_s=10, lease_s=3601)
        status = wire(await r.control.status())
    assert refused.value.code == "invalid_request" and "lease_s" in refused.value.message
    assert status["phase"] == "idle"


def test_control_errors_keep_their_class_across_processes() -> None:
    timeout = pickle.loads(pickle.dumps(ControlTimeout("no reply", code="timeout", status=0)))
    assert type(timeout) is ControlTimeout and timeout.code == "timeout"
    refused = pickle.loads(pickle.dumps(ControlError("no", code="wrong_phase", status=409)))
    assert type(refused) is ControlError and str(refused) == "HTTP 409 wrong_phase: no"


# --- ids and ordering -----------------------------------------------------------------------


async def test_a_resumed_id_is_stale_before_any_other_rule(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument
) -> None:
    async with rig() as r:
        await r.control.prepare("c1", timeout_s=5)
        await r.control.resume("c1", timeout_s=5)
        await r.control.prepare("c2", timeout_s=5)  # c2 is active: c1 would also conflict
        refusals = []
        for call in (
            r.control.prepare("c1", timeout_s=5),
            r.control.commit("c1", "/tmp/never", timeout_s=5),
            r.control.retire("c1", [("x", 0)], timeout_s=5),
            r.control.forget("c1", timeout_s=5),
            r.control.restore("c1", "/tmp/never", timeout_s=5),
        ):
            with pytest.raises(ControlError) as refused:
                await call
            refusals.append(refused.value.code)
        await r.control.resume("c2", timeout_s=5)
    assert refusals == ["stale_checkpoint"] * 5


async def test_concurrent_commits_of_one_checkpoint_write_one_export(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with rig() as r:
        r.stream_in_background("batch", [episode("a", think_s=10)])
        await trio.sleep(5)
        await r.control.prepare("c1", timeout_s=30)
        outcomes: list[Any] = []

        async def commit() -> None:
            try:
                outcomes.append(
                    await r.host.services.checkpoints.commit(
                        "c1", wall() + 30, tmp_path / "x", None
                    )
                )
            except WireError as exc:
                outcomes.append(exc)

        async with trio.open_nursery() as both:
            both.start_soon(commit)
            both.start_soon(commit)
        await r.control.resume("c1", timeout_s=5)
    replies = [o for o in outcomes if not isinstance(o, WireError)]
    refusals = [o for o in outcomes if isinstance(o, WireError)]
    assert len(replies) == 1 and len(refusals) == 1
    assert refusals[0].code == "checkpoint_conflict" and "being committed" in str(refusals[0])


async def test_a_manifest_is_never_replaced_by_another_checkpoint(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with rig() as r:
        r.stream_in_background("batch", [episode("a", think_s=10)])
        await trio.sleep(5)
        await r.control.prepare("c1", timeout_s=30)
        first = wire(await r.control.commit("c1", str(tmp_path / "x"), timeout_s=30))
        before = (tmp_path / "x" / MANIFEST).read_bytes()
        await r.control.resume("c1", timeout_s=5)
        await r.control.prepare("c2", timeout_s=30)
        with pytest.raises(ControlError) as refused:
            await r.control.commit("c2", str(tmp_path / "x"), timeout_s=30)
        status = wire(await r.control.status())
        await r.control.resume("c2", timeout_s=5)
    assert (
        refused.value.code == "checkpoint_conflict" and "fresh directory" in refused.value.message
    )
    assert (tmp_path / "x" / MANIFEST).read_bytes() == before
    assert json.loads(before)["checkpoint_id"] == first["checkpoint_id"] == "c1"
    assert status["phase"] == "prepared"  # the failed commit changed nothing


# --- scopes ---------------------------------------------------------------------------------


async def test_commit_and_restore_honour_a_capture_key_scope(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with rig() as a:
        a.stream_in_background("batch", [episode(rid, think_s=10) for rid in ("a", "b", "c")])
        await trio.sleep(5)
        await a.control.prepare("c1", timeout_s=30)
        with pytest.raises(ControlError) as twice:
            wire(
                await a.control.commit(
                    "c1", str(tmp_path / "x"), timeout_s=30, capture_keys=["a", "a"]
                )
            )
        committed = wire(
            await a.control.commit("c1", str(tmp_path / "x"), timeout_s=30, capture_keys=["c", "a"])
        )
        await a.control.resume("c1", timeout_s=5)
    assert twice.value.code == "invalid_request"
    assert committed["capture_keys"] == ["a", "c"]
    assert all(p["capture_keys"] == ["a", "c"] for p in committed["participants"])
    async with rig() as b:
        restored = wire(
            await b.control.restore("r1", str(tmp_path / "x"), timeout_s=30, capture_keys=["c"])
        )
        status = wire(await b.control.status())
        await b.control.resume("r1", timeout_s=5)
    assert [e["capture_key"] for e in restored["restored"]] == ["c-a1"]
    assert status["counts"]["restored"] == 1
    assert len(b.runner.inner.store) == 1  # only c's calendar came back


# --- what restore accepts -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda m: m["participants"][0].update(record_count=5), "records, the manifest says 5"),
        (lambda m: m["participants"][0].update(records_file="../../manifest.json"), "records_file"),
        (lambda m: m["participants"][0].update(kind=".."), "kind"),
        (lambda m: m["participants"][0].pop("sha256"), "sha256"),
        (lambda m: m.update(participants=[]), "participants"),
        (lambda m: m["participants"].append(m["participants"][0]), "twice"),
    ],
    ids=["record-count", "path-escape", "dot-dot-kind", "no-digest", "no-topology", "repeated"],
)
async def test_a_malformed_manifest_is_refused_and_changes_nothing(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
    tmp_path: Path,
    change: Any,
    fragment: str,
) -> None:
    directory = await exported(tmp_path, "a")
    rewrite_manifest(directory, change)
    async with rig() as fresh:
        with pytest.raises(ControlError) as refused:
            await fresh.control.restore("r1", str(directory), timeout_s=30)
        status = wire(await fresh.control.status())
    assert (refused.value.status, refused.value.code) == (422, "export_invalid")
    assert fragment in refused.value.message
    assert status["phase"] == "idle" and status["counts"]["restored"] == 0
    assert len(fresh.runner.inner.store) == 0


async def test_a_malformed_host_record_is_refused_even_with_a_matching_digest(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    directory = await exported(tmp_path, "a")
    rewrite_records(
        directory, "episodes", lambda rows: [{**row, "attempt": "0"} for row in rows]
    )  # a string attempt
    async with rig() as fresh:
        with pytest.raises(ControlError) as refused:
            await fresh.control.restore("r1", str(directory), timeout_s=30)
    assert refused.value.code == "export_invalid"
    assert "host record 1 is malformed" in refused.value.message
    assert len(fresh.runner.inner.store) == 0


async def test_a_participant_holding_other_episodes_is_refused(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    directory = await exported(tmp_path, "a", "b")
    manifest = json.loads((directory / MANIFEST).read_text())
    (store,) = [p for p in manifest["participants"] if p["kind"] != "episodes"]
    rewrite_records(
        directory, store["kind"], lambda rows: [r for r in rows if r["capture_key"] == "a"]
    )
    async with rig() as fresh:
        with pytest.raises(ControlError) as refused:
            await fresh.control.restore("r1", str(directory), timeout_s=30)
        status = wire(await fresh.control.status())
    assert refused.value.code == "export_invalid"
    name = f"{store['server_name']}/{store['kind']}"
    assert f"participant {name} holds records for 1 episode(s), the host for 2" in (
        refused.value.message
    )
    assert status["phase"] == "idle" and status["counts"]["restored"] == 0
    assert len(fresh.runner.inner.store) == 0


async def test_a_second_restore_is_refused_and_changes_nothing(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    directory = await exported(tmp_path, "a", "b")
    async with rig() as r:
        first = wire(await r.control.restore("r1", str(directory), timeout_s=30))
        assert wire(await r.control.restore("r1", str(directory), timeout_s=30)) == first  # replay
        with pytest.raises(ControlError) as while_restored:
            await r.control.restore("r2", str(directory), timeout_s=30)
        status = wire(await r.control.status())
        await r.client.run([episode("a", think_s=10, meetings=4, _ng_attempt_index=1)])
        await r.control.resume("r1", timeout_s=5)
        with pytest.raises(ControlError) as again:
            await r.control.restore("r3", str(directory), timeout_s=30)
        after = wire(await r.control.status())
    assert while_restored.value.code == "checkpoint_conflict"
    assert status["counts"]["restored"] == 2 and len(r.runner.inner.store) >= 1
    assert (again.value.status, again.value.code) == (409, "checkpoint_conflict")
    assert "already restored here" in again.value.message
    assert after["phase"] == "idle" and after["counts"]["restored"] == 1  # b still waits
    assert after["admission"] == "open"


# --- admission and restored episodes -------------------------------------------------------------


async def test_one_capture_key_cannot_run_twice_at_once(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument
) -> None:
    async with rig() as r:
        r.stream_in_background("first", [episode("dup", think_s=10)])
        await trio.sleep(1)
        with pytest.raises(RolloutError) as second:
            await r.client.run([episode("dup", think_s=10)])
        rows = await r.finish("first")
    assert second.value.code == "stale_attempt" and "already running" in second.value.message
    assert rows[0][1].ok


async def test_a_restored_episode_survives_a_refused_batch(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    directory = await exported(tmp_path, "a")
    again = episode("a", think_s=10, meetings=4, _ng_attempt_index=1)
    async with rig() as r:
        await r.control.restore("r1", str(directory), timeout_s=30)
        with pytest.raises(RolloutError) as refused:  # the old attempt spoils the document
            await r.client.post([again, episode("a", think_s=10)])
        results = await r.client.run([again])
        await r.control.resume("r1", timeout_s=5)
    assert refused.value.code == "stale_attempt"
    assert results[0]["_ng_attempt_index"] == 1 and results[0]["steps"] == 4
    assert len(r.runner.started) == 1  # the refused batch started nothing


async def test_the_deadline_runs_on_after_a_resume(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument
) -> None:
    async with rig(rollout_deadline_s=100) as r:
        # Five steps of 30 s in a 100 s deadline: parked at 60 s with 40 s left, resumed at
        # 300 s, so the deadline falls at 340 s, mid-way through the fourth step.
        r.stream_in_background("batch", [episode("d", think_s=30, meetings=5)])
        await trio.sleep(40)
        await r.control.prepare("c1", timeout_s=60, lease_s=1000)
        await trio.sleep_until(300)
        await r.control.resume("c1", timeout_s=5)
        ((at, row),) = await r.finish("batch")
    assert at == 340 and isinstance(row, RolloutError) and row.code == "deadline_exceeded"


# --- retire and forget ------------------------------------------------------------------------


async def test_retire_frees_a_restored_episode_and_its_records(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    directory = await exported(tmp_path, "a", "b")
    async with rig() as r:
        await r.control.restore("r1", str(directory), timeout_s=30)
        assert len(r.runner.inner.store) == 2
        retired = wire(await r.control.retire("r1", [("a", 1)], timeout_s=5))
        with pytest.raises(RolloutError) as stale:
            await r.client.run([episode("a", think_s=10, meetings=4, _ng_attempt_index=1)])
        status = wire(await r.control.status())
        await r.control.resume("r1", timeout_s=5)
    assert retired["complete"] and stale.value.code == "stale_attempt"
    assert len(r.runner.inner.store) == 1  # a's calendar is gone, b's waits
    assert status["counts"]["restored"] == 1


async def test_retire_and_forget_replay_or_conflict_by_their_arguments(
    disk_clock: trio.abc.Clock,
    threads_hold_the_clock: trio.abc.Instrument,
) -> None:
    async with rig() as r:
        first = wire(await r.control.retire("t1", [("x", 0)], timeout_s=5))
        assert wire(await r.control.retire("t1", [("x", 0)], timeout_s=5)) == first
        with pytest.raises(ControlError) as retire_conflict:
            await r.control.retire("t1", [("y", 0)], timeout_s=5)
        forgot = wire(await r.control.forget("f1", ["x"], timeout_s=5))
        assert wire(await r.control.forget("f1", ["x"], timeout_s=5)) == forgot
        with pytest.raises(ControlError) as forget_conflict:
            await r.control.forget("f1", None, timeout_s=5)
        await r.control.prepare("c1", timeout_s=5)
        with pytest.raises(ControlError) as during:
            await r.control.forget("f2", None, timeout_s=5)
        await r.control.resume("c1", timeout_s=5)
        status = wire(await r.control.status())
    assert retire_conflict.value.code == forget_conflict.value.code == "checkpoint_conflict"
    assert forgot["forgotten"] == 1
    assert during.value.code == "wrong_phase"
    assert status["counts"]["retired"] == 0  # y was never retired


async def test_an_unreachable_host_is_a_control_timeout(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument
) -> None:
    async def refuse(endpoint: Any) -> Any:
        raise OSError("connection refused")

    control = HostControl("http://host:1", TOKEN, opener=refuse, wall_time=wall)
    with pytest.raises(ControlTimeout) as unreachable:
        await control.status(timeout_s=5)
    assert unreachable.value.code == "unreachable"


def test_every_operation_of_the_protocols_table_is_routed_and_carried_out() -> None:
    """The host routes the protocol's own table: no operation is left to a 404 or a 500."""
    posted = {op for op in OPERATIONS.values() if op is not STATUS}
    assert set(CARRY_OUT) == posted
    assert {path for path, methods in ROUTES.items() if b"POST" in methods} >= {
        op.path for op in posted
    }
    assert ROUTES[STATUS.path].keys() == {b"GET"}
