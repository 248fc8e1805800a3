"""The one scheduler over real processes with faults injected: four hosts launched as
`trio-gym serve`, a checkpoint every second, two hosts SIGKILLed at random points. Each lost host
is replaced by its provider, its episodes of the last checkpoint continue on the replacement,
and every episode is consumed exactly once with the side effects of one uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import uuid
from collections import Counter
from functools import partial
from pathlib import Path

import trio

from tests.fleet import calendar, uninterrupted
from tests.processes import HANG_GUARD_S, kill_all, processes_with
from trio_gym.fleet import HostSpec, LocalProvider
from trio_gym.trainer import CheckpointCoordinator, CheckpointSettings, CheckpointUnavailable
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.dispatch import Dispatcher, SealedResult
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.scheduler import RemoteHost, SchedulerSettings

TOKEN_VARIABLE = "TRIO_GYM_FAULT_TEST"
CONTROL_TOKEN = "fault-token"
GROUPS = {
    f"w{wave}g{i}": [calendar(1000 * wave + 10 * i + j, think_s=0.4, meetings=6) for j in range(2)]
    for wave in range(3)
    for i in range(8)
}
"""Three waves of eight groups of two, each episode six steps of 0.4 s: the run outlasts both
kills."""


async def test_four_hosts_two_killed_checkpoints_every_second_each_episode_once(
    tmp_path: Path,
) -> None:
    token = uuid.uuid4().hex
    spec = HostSpec(
        {TOKEN_VARIABLE: token},
        ("--heartbeat-interval", "0.2"),
        control_token=CONTROL_TOKEN,
        ready_timeout_s=30.0,
        stop_grace_s=2.0,
    )
    provider = LocalProvider()
    consumed: list[SealedResult] = []
    checkpoints: list[str] = []
    unavailable: list[str] = []
    killed: list[str] = []
    chance = random.Random(24)
    deadlines = DeadlineRegistry()
    connect = partial(
        RemoteHost.launched, settings=ClientSettings(request_deadline_s=120), deadlines=deadlines
    )
    try:
        with trio.fail_after(HANG_GUARD_S * 2):
            async with provider.hosts(4, spec) as handles:
                dispatcher = Dispatcher(
                    [connect(handle) for handle in handles],
                    consumed.append,
                    deadlines=deadlines,
                    scheduler=SchedulerSettings(probe_interval_s=0.2, max_host_failures=2),
                    launcher=provider,
                    connect=connect,
                )
                coordinator = CheckpointCoordinator(
                    dispatcher,
                    settings=CheckpointSettings(
                        control_timeout_s=5, prepare_timeout_s=5, drain_timeout_s=10
                    ),
                    trainer_state=lambda: {"consumed": len(consumed)},
                )
                async with dispatcher, trio.open_nursery() as nursery:

                    async def checkpoint_every_second() -> None:
                        while True:
                            await trio.sleep(1)
                            try:
                                manifest = await coordinator.checkpoint(
                                    tmp_path / f"ckpt-{len(checkpoints) + len(unavailable)}"
                                )
                            except CheckpointUnavailable as failure:
                                unavailable.append(str(failure))
                            else:
                                checkpoints.append(manifest.checkpoint_id)

                    async def kill_two() -> None:
                        for _ in range(2):
                            await trio.sleep(chance.uniform(1.0, 3.0))
                            victim = chance.choice(sorted(dispatcher.hosts))
                            pid = provider.host_pid(dispatcher.hosts[victim].handle)
                            assert pid is not None
                            os.kill(pid, signal.SIGKILL)
                            killed.append(victim)

                    nursery.start_soon(checkpoint_every_second)
                    nursery.start_soon(kill_two)
                    for wave in range(3):
                        async with trio.open_nursery() as groups:
                            for group_id, examples in GROUPS.items():
                                if group_id.startswith(f"w{wave}"):
                                    groups.start_soon(dispatcher.run_group, group_id, examples)
                    nursery.cancel_scope.cancel()
                recovered = dispatcher.recovered_total
                replaced = sorted(dispatcher.hosts)
        left = processes_with(TOKEN_VARIABLE, token)
    finally:
        kill_all(TOKEN_VARIABLE, token)
    counted = Counter((r.group_id, r.sibling) for r in consumed)
    assert counted == Counter({(g, i): 1 for g in GROUPS for i in range(2)})
    for sealed in consumed:
        assert sealed.error is None, sealed.error
        expected = await uninterrupted(GROUPS[sealed.group_id][sealed.sibling])
        assert sealed.result["booked"] == expected["booked"]  # each step's side effect once
        assert sealed.result["reward"] == expected["reward"]
    assert len(killed) == 2 and not set(killed) & set(replaced)  # both replaced
    assert len(replaced) == 4 and checkpoints  # checkpoints were taken around the faults
    assert recovered >= 1  # at least one episode continued from a checkpoint on a successor
    assert left == []
