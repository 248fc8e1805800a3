"""The coordinator against real hosts: `trio-gym serve` subprocesses on loopback, real clock."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.fleet import calendar, uninterrupted
from tests.helpers import wire
from tests.live import TOKEN, LiveHost, live_hosts
from trio_gym.trainer import ClientSettings, HostClient
from trio_gym.trainer.control import HostControl
from trio_gym.trainer.coordinator import (
    CheckpointCoordinator,
    CheckpointSettings,
    CheckpointUnavailable,
    RestoreRefused,
)
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.dispatch import Dispatcher, DispatchSettings, SealedResult
from trio_gym.trainer.hosts import HostHandle
from trio_gym.trainer.scheduler import RemoteHost

GRACE_S = 0.5
SCRIPTED = "tests.helpers:ScriptedRunner"
HANG_GUARD_S = 60


def trainer(
    hosts: dict[str, LiveHost],
    consumed: list[SealedResult],
    checkpoint: CheckpointSettings | None = None,
    dispatch: DispatchSettings | None = None,
) -> CheckpointCoordinator:
    deadlines = DeadlineRegistry()
    handles = [
        RemoteHost(
            HostHandle(name, host.url, control_token=TOKEN),
            HostClient(host.url, ClientSettings(request_deadline_s=120), deadlines=deadlines),
            HostControl(host.url, TOKEN, reply_grace_s=GRACE_S),
        )
        for name, host in hosts.items()
    ]
    dispatcher = Dispatcher(handles, consumed.append, settings=dispatch, deadlines=deadlines)
    return CheckpointCoordinator(
        dispatcher,
        settings=checkpoint or CheckpointSettings(control_timeout_s=10),
        trainer_state=lambda: {"consumed": [[r.group_id, r.sibling] for r in consumed]},
    )


GROUPS = {
    f"g{i}": [calendar(10 * i + j, think_s=0.3, meetings=3) for j in range(2)] for i in range(3)
}


async def run_groups(
    coordinator: CheckpointCoordinator, groups: dict[str, list[dict[str, Any]]]
) -> None:
    async with coordinator.dispatcher, trio.open_nursery() as nursery:
        for group_id, examples in groups.items():
            nursery.start_soon(coordinator.dispatcher.run_group, group_id, examples)


async def statuses(hosts: dict[str, LiveHost]) -> dict[str, dict[str, Any]]:
    return {name: wire(await host.control().status(timeout_s=5)) for name, host in hosts.items()}


async def test_a_full_cycle_and_a_restore_against_live_hosts(tmp_path: Path) -> None:
    first: list[SealedResult] = []
    with trio.fail_after(HANG_GUARD_S):
        async with live_hosts(a="example", b="example") as hosts:
            coordinator = trainer(hosts, first)
            async with trio.open_nursery() as work:
                work.start_soon(run_groups, coordinator, GROUPS)
                await trio.sleep(0.45)  # every episode is in its second step
                manifest = await coordinator.checkpoint(tmp_path / "c1")
            after_run = await statuses(hosts)
            # The trainer restarts; the hosts live on (they finished the episodes meanwhile).
            second: list[SealedResult] = []
            again = trainer(hosts, second)
            restored = await again.restore(tmp_path / "c1")
            await run_groups(again, {g: GROUPS[g] for g in restored.groups})
    exported = {key: host.instance for host in manifest.hosts for key in host.episodes}
    assert exported and all(s["phase"] == "idle" for s in after_run.values())
    assert Counter((r.group_id, r.sibling) for r in first) == Counter(
        {(g, i): 1 for g in GROUPS for i in range(2)}
    )
    saved = [tuple(pair) for pair in restored.trainer_state["consumed"]]
    assert Counter(saved + [(r.group_id, r.sibling) for r in second]) == Counter(
        {(g, i): 1 for g in GROUPS for i in range(2)}
    )
    for sealed in second:
        assert sealed.attempt == 1 and exported[sealed.rollout_id] == sealed.host
        expected = await uninterrupted(GROUPS[sealed.group_id][sealed.sibling])
        assert sealed.result["booked"] == expected["booked"]
        assert sealed.result["reward"] == expected["reward"]


@pytest.mark.parametrize("operation", ["prepare", "commit"])
async def test_a_host_that_never_answers_is_timed_out_everyone_resumes_and_it_is_retried(
    tmp_path: Path, operation: str
) -> None:
    consumed: list[SealedResult] = []
    settings = CheckpointSettings(control_timeout_s=1.0, prepare_timeout_s=1.0)
    with trio.fail_after(HANG_GUARD_S):
        async with live_hosts(a="example", b="example") as hosts:
            coordinator = trainer(hosts, consumed, checkpoint=settings)
            hosts["b"].proxy.swallow.add(operation)
            async with trio.open_nursery() as work:
                work.start_soon(run_groups, coordinator, GROUPS)
                await trio.sleep(0.45)
                with pytest.raises(CheckpointUnavailable) as unavailable:
                    await coordinator.checkpoint(tmp_path / "c1")
                during = await statuses(hosts)
                hosts["b"].proxy.swallow.clear()
                manifest = await coordinator.checkpoint(tmp_path / "c2")  # the next opportunity
    assert f"no reply from 127.0.0.1:{hosts['b'].port} within 1 s + {GRACE_S:g} s grace" in str(
        unavailable.value
    )
    assert hosts["b"].proxy.swallowed == [operation] and hosts["b"].proxy.abandoned == 1
    assert all(s["phase"] == "idle" and s["admission"] == "open" for s in during.values())
    assert manifest.checkpoint_id != unavailable.value.checkpoint_id
    assert len({(r.group_id, r.sibling) for r in consumed}) == len(consumed) == 6


async def test_a_renewal_that_never_answers_fails_the_checkpoint(tmp_path: Path) -> None:
    consumed: list[SealedResult] = []
    settings = CheckpointSettings(control_timeout_s=5.0, lease_s=1.5, drain_timeout_s=30)
    with trio.fail_after(HANG_GUARD_S):
        async with live_hosts(s=SCRIPTED) as hosts:
            coordinator = trainer(hosts, consumed, checkpoint=settings)
            hosts["s"].proxy.swallow.add("renew")
            async with trio.open_nursery() as work:
                # No step boundaries: never parked, drained (its reply comes after 5 s).
                work.start_soon(run_groups, coordinator, {"slow": [{"sleep_s": 5.0}]})
                await trio.sleep(0.3)
                with pytest.raises(CheckpointUnavailable, match="a lease renewal failed") as fail:
                    await coordinator.checkpoint(tmp_path / "c1")
                during = await statuses(hosts)
    assert "renew: no reply" in str(fail.value)
    assert during["s"]["phase"] == "idle"
    assert [r.group_id for r in consumed] == ["slow"]  # the drained episode was consumed once
    assert not (tmp_path / "c1" / "gym_checkpoint.json").exists()


async def test_a_host_that_dies_makes_the_checkpoint_unavailable_and_the_others_resume(
    tmp_path: Path,
) -> None:
    consumed: list[SealedResult] = []
    settings = CheckpointSettings(control_timeout_s=2.0)
    with trio.fail_after(HANG_GUARD_S):
        async with live_hosts(a="example", b="example") as hosts:
            coordinator = trainer(hosts, consumed, checkpoint=settings)
            async with trio.open_nursery() as work:
                work.start_soon(run_groups, coordinator, GROUPS)
                await trio.sleep(0.45)
                hosts["b"].process.send_signal(signal.SIGKILL)
                await hosts["b"].process.wait()
                with pytest.raises(CheckpointUnavailable) as unavailable:
                    await coordinator.checkpoint(tmp_path / "c1")
                alive = wire(await hosts["a"].control().status(timeout_s=5))
                work.cancel_scope.cancel()
    assert "b: " in str(unavailable.value)
    assert alive["phase"] == "idle" and alive["admission"] == "open"
    assert not (tmp_path / "c1" / "gym_checkpoint.json").exists()


async def test_restores_that_do_not_fit_live_hosts_or_their_files_change_nothing(
    tmp_path: Path,
) -> None:
    consumed: list[SealedResult] = []
    with trio.fail_after(HANG_GUARD_S):
        async with live_hosts(a="example", b="example", c=SCRIPTED) as hosts:
            pair = {name: hosts[name] for name in "ab"}
            coordinator = trainer(pair, consumed)
            async with trio.open_nursery() as work:
                work.start_soon(run_groups, coordinator, GROUPS)
                await trio.sleep(0.45)
                manifest = await coordinator.checkpoint(tmp_path / "c1")
            swapped = {"a": hosts["a"], "b": hosts["c"]}  # b now runs another environment
            before = await statuses(hosts)
            with pytest.raises(RestoreRefused, match="b now has participants") as topology:
                await trainer(swapped, []).restore(tmp_path / "c1")
            export = next(host for host in manifest.hosts if host.episodes)
            part = next(p for p in export.participants if p.kind == "side_effect_store")
            records = tmp_path / "c1" / part.state_directory
            (records / part.records_file).write_text('{"capture_key": "forged"}\n')
            with pytest.raises(RestoreRefused, match="SHA-256") as digest:
                await trainer(pair, []).restore(tmp_path / "c1")
            after = await statuses(hosts)
    assert "calendar" in str(topology.value) and part.records_file in str(digest.value)
    assert before == after  # no host changed: no phase, no restored episode, no retire mark
    assert all(s["counts"]["restored"] == 0 and s["phase"] == "idle" for s in after.values())
