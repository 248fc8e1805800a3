"""A host lost inside a run: the one scheduler ejects it, its heir takes its work, and its
episodes of the last checkpoint continue there exactly once (virtual clock, in-process hosts)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.fleet import Fleet, calendar, fleet, uninterrupted
from trio_gym.trainer import CheckpointSettings, CheckpointUnavailable
from trio_gym.trainer.scheduler import SchedulerSettings

GROUPS = {
    "long": [calendar(1, think_s=5.0), calendar(2, think_s=5.0)],
    "short": [calendar(3, think_s=1.0, meetings=1), calendar(4, think_s=1.0, meetings=1)],
    "mixed": [calendar(5, think_s=4.0), calendar(6, think_s=0.5, meetings=2)],
}
QUICK = SchedulerSettings(probe_interval_s=0.5, max_host_failures=2)


async def run_all(f: Fleet, groups: dict[str, list[dict[str, Any]]]) -> None:
    async with trio.open_nursery() as nursery:
        for group_id, examples in groups.items():
            nursery.start_soon(f.dispatcher.run_group, group_id, examples)


def each_once(f: Fleet) -> bool:
    counted = Counter((r.group_id, r.sibling) for r in f.consumed)
    return counted == Counter({(g, i): 1 for g in GROUPS for i in range(2)})


async def assert_results_are_uninterrupted(f: Fleet) -> None:
    for sealed in f.consumed:
        assert sealed.error is None
        expected = await uninterrupted(GROUPS[sealed.group_id][sealed.sibling])
        assert sealed.result["booked"] == expected["booked"]  # its side effects, once


async def test_a_host_lost_between_checkpoints_is_replaced_and_its_episodes_continue_there(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with fleet(replaceable=True, scheduler=QUICK) as f, trio.open_nursery() as nursery:
        nursery.start_soon(run_all, f, GROUPS)
        await trio.sleep(7)  # long.* and mixed.0 are mid-episode
        manifest = await f.coordinator.checkpoint(tmp_path / "c1")
        exported = {key: host.instance for host in manifest.hosts for key in host.episodes}
        victim = next(host for host in sorted(set(exported.values())))
        await trio.sleep(1)
        f.kill(victim)
    assert f.world.replaced == [(victim, f"{victim}-r1")]
    assert each_once(f)
    await assert_results_are_uninterrupted(f)
    from_checkpoint = [r for r in f.consumed if exported.get(r.rollout_id) == victim]
    assert from_checkpoint and all(r.attempt == 1 for r in from_checkpoint)
    assert {r.host for r in from_checkpoint} == {f"{victim}-r1"}
    assert f.dispatcher.recovered_total == len(from_checkpoint)
    assert victim not in f.dispatcher.hosts and f.dispatcher.scheduler.ejected == {}


async def test_without_a_launcher_the_least_loaded_host_left_inherits_the_lost_ones_work(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with fleet(("a", "b", "c"), scheduler=QUICK) as f, trio.open_nursery() as nursery:
        nursery.start_soon(run_all, f, GROUPS)
        await trio.sleep(7)
        manifest = await f.coordinator.checkpoint(tmp_path / "c1")
        exported = {key: host.instance for host in manifest.hosts for key in host.episodes}
        victim = sorted(set(exported.values()))[0]
        await trio.sleep(1)
        f.kill(victim)
    assert each_once(f)
    await assert_results_are_uninterrupted(f)
    heirs = {r.host for r in f.consumed if exported.get(r.rollout_id) == victim}
    assert len(heirs) == 1 and victim not in heirs
    assert list(f.dispatcher.scheduler.ejected) == [victim]


async def test_a_host_lost_before_any_checkpoint_has_its_work_run_afresh_on_the_replacement(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet(replaceable=True, scheduler=QUICK) as f, trio.open_nursery() as nursery:
        nursery.start_soon(run_all, f, GROUPS)
        await trio.sleep(3)
        f.kill("b")
    assert each_once(f)
    await assert_results_are_uninterrupted(f)
    assert f.dispatcher.recovered_total == 0
    on_replacement = [r for r in f.consumed if r.host == "b-r1"]
    assert on_replacement and all(r.attempt == 0 and ".g1" in r.rollout_id for r in on_replacement)


async def test_a_checkpoint_waits_for_a_lost_hosts_heir_within_the_gate_timeout(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    settings = CheckpointSettings(gate_timeout_s=10)
    async with (
        fleet(replaceable=True, scheduler=QUICK, checkpoint=settings) as f,
        trio.open_nursery() as nursery,
    ):
        slow = f.world.replace

        async def slow_replace(handle: Any) -> Any:
            await trio.sleep(25)  # a sandbox platform takes its time
            return await slow(handle)

        f.world.replace = slow_replace  # type: ignore[method-assign]
        nursery.start_soon(run_all, f, GROUPS)
        await trio.sleep(3)
        f.kill("b")
        await trio.sleep(2)  # ejected by now, its replacement starting
        asked = trio.current_time()
        with pytest.raises(CheckpointUnavailable, match="gate_timeout_s: a replacement"):
            await f.coordinator.checkpoint(tmp_path / "c1")
        assert trio.current_time() - asked == 10
        await trio.sleep(5)
        again = trio.current_time()
        manifest = await f.coordinator.checkpoint(tmp_path / "c2")  # waits for b-r1
        assert trio.current_time() - again < 10
    assert "b-r1" in {host.instance for host in manifest.hosts}
    assert each_once(f)


async def test_work_sent_to_a_host_already_dead_follows_it_to_its_replacement(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Nothing had noticed b die: its siblings' sends do not land, and while they wait out
    their backoff b is replaced and their attempts move; the group follows them there."""
    async with fleet(replaceable=True, scheduler=QUICK) as f:
        f.kill("b")
        await f.dispatcher.run_group("g", [calendar(i, think_s=1.0) for i in range(4)])
    assert sorted(r.sibling for r in f.consumed) == [0, 1, 2, 3]
    assert {r.host for r in f.consumed} == {"a", "b-r1"}
    assert all(r.attempt == 0 and ".g" not in r.rollout_id for r in f.consumed)  # never lost


async def test_a_host_a_checkpoint_cannot_reach_is_probed_ejected_and_replaced(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    """No send goes to b when it dies, but the checkpoint's control call finds it: the
    scheduler probes it, finds it gone and replaces it; the next checkpoint has its heir."""
    async with fleet(replaceable=True, scheduler=QUICK) as f:
        f.kill("b")
        with pytest.raises(CheckpointUnavailable, match="b: status"):
            await f.coordinator.checkpoint(tmp_path / "c1")
        with trio.fail_after(60):
            assert await f.dispatcher.scheduler.until_lost("b") == "b-r1"
        manifest = await f.coordinator.checkpoint(tmp_path / "c2")
    assert {host.instance for host in manifest.hosts} == {"a", "b-r1"}


async def test_a_host_ejected_while_it_lives_has_its_streams_cut_and_runs_nothing_twice(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Found in review: b is ejected (two control calls it did not answer, then a probe) while
    it lives and streams; its requests are cut and given up before its work moves to its
    heir, so no row of a moved attempt is sealed and each episode runs once."""
    async with fleet(("a", "b", "c"), scheduler=QUICK) as f, trio.open_nursery() as nursery:
        nursery.start_soon(
            f.dispatcher.run_group, "g", [calendar(i, think_s=2.0) for i in range(3)]
        )
        await trio.sleep(1)  # every sibling mid-episode, one per host
        f.dispatcher.scheduler.suspect("b", "a control call failed: timeout")
        f.dispatcher.scheduler.suspect("b", "a control call failed: timeout")
    assert Counter(r.sibling for r in f.consumed) == Counter({0: 1, 1: 1, 2: 1})
    completed = {name: len(runner.completed) for name, runner in f.runners.items()}
    assert sum(completed.values()) == 3 and completed["b"] == 0, completed
    assert f.runners["b"].cancelled  # its copy was stopped, not left to run
