"""``trio-gym demo --fleet``: the whole trainer loop on one machine, with a host lost mid-run.

Four hosts run as real ``trio-gym serve`` processes (the example environment); a checkpointing
dispatcher over them — the one scheduler — runs groups of episodes. A checkpoint is taken while
the episodes are mid-way; then the host holding the most parked episodes is killed (SIGKILL).
The scheduler finds it gone, its provider launches a replacement, and the episodes that host had
in the checkpoint continue on the replacement from where they were parked; the rest of its work
runs there afresh. Every event is printed as it happens; the summary counts what proves that
each episode was consumed exactly once, with the side effects of one uninterrupted run.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import tempfile
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Final, TextIO

import trio

from trio_gym.fleet import HostSpec, LocalProvider
from trio_gym.runners import ExampleContext, ExampleRunner
from trio_gym.trainer.coordinator import CheckpointCoordinator, CheckpointUnavailable
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.dispatch import Dispatcher, SealedResult
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.scheduler import RemoteHost, SchedulerSettings

HOSTS: Final = 4
SIBLINGS: Final = 2
THINK_S: Final = 0.4
MEETINGS: Final = 6
CHECKPOINT_AT_S: Final = 1.2
"""Into the run: every episode is mid-way (six steps of 0.4 s)."""


class FleetView:
    """What the demo prints, stamped with seconds since the start."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.started = trio.current_time()
        self.done: Counter[str] = Counter()

    def say(self, text: str) -> None:
        print(f"  [{trio.current_time() - self.started:5.1f}s] {text}", file=self.out, flush=True)

    def sealed(self, result: SealedResult) -> None:
        self.done[result.host] += 1
        how = "continued from the checkpoint" if result.attempt else "ran"
        per_host = "  ".join(f"{host} {count}" for host, count in sorted(self.done.items()))
        self.say(f"{result.group_id}.{result.sibling} {how} on {result.host}  |  {per_host}")


def fleet_examples(episodes: int) -> dict[str, list[dict[str, Any]]]:
    """Groups of ``SIBLINGS`` calendar episodes, ``episodes`` in all (rounded up)."""
    groups = -(-episodes // SIBLINGS)
    return {
        f"prompt-{g}": [
            {"seed": SIBLINGS * g + s, "meetings": MEETINGS, "think_s": THINK_S}
            for s in range(SIBLINGS)
        ]
        for g in range(groups)
    }


async def run_fleet_demo(episodes: int, out: TextIO = sys.stderr) -> int:
    """Run the demo; return the process exit status (0: every count adds up)."""
    groups = fleet_examples(episodes)
    view = FleetView(out)
    consumed: list[SealedResult] = []
    missed: list[str] = []

    def on_result(result: SealedResult) -> None:
        consumed.append(result)
        view.sealed(result)

    spec = HostSpec(
        {"NMP_RUNNER": "example"},
        ("--heartbeat-interval", "0.5"),
        control_token=secrets.token_hex(16),
        ready_timeout_s=120.0,
    )
    provider = LocalProvider()
    print(f"trio-gym demo --fleet: launching {HOSTS} hosts (trio-gym serve, the example "
          "environment)", file=out)  # fmt: skip
    deadlines = DeadlineRegistry()
    connect = partial(
        RemoteHost.launched, settings=ClientSettings(request_deadline_s=300), deadlines=deadlines
    )
    with tempfile.TemporaryDirectory(prefix="trio-gym-fleet-") as scratch:
        async with provider.hosts(HOSTS, spec) as handles:
            dispatcher = Dispatcher(
                [connect(handle) for handle in handles],
                on_result,
                deadlines=deadlines,
                scheduler=SchedulerSettings(probe_interval_s=0.2, max_host_failures=2),
                launcher=provider,
                connect=connect,
            )
            coordinator = CheckpointCoordinator(
                dispatcher, trainer_state=lambda: {"consumed": len(consumed)}
            )
            view.started = trio.current_time()
            names = ", ".join(handle.name for handle in handles)
            view.say(f"hosts up: {names}; {sum(map(len, groups.values()))} episodes in "
                     f"{len(groups)} groups")  # fmt: skip
            async with dispatcher, trio.open_nursery() as nursery:
                nursery.start_soon(
                    _checkpoint_then_kill, coordinator, provider, Path(scratch), view, missed
                )
                async with trio.open_nursery() as running:
                    for group_id, examples in groups.items():
                        running.start_soon(dispatcher.run_group, group_id, examples)
                nursery.cancel_scope.cancel()
            elapsed = trio.current_time() - view.started
            recovered, hosts_now = dispatcher.recovered_total, sorted(dispatcher.hosts)
    status = await _summary(groups, consumed, recovered, hosts_now, elapsed, sys.stdout)
    if missed:
        print(f"trio-gym demo --fleet: no host loss was shown: {missed[0]}", file=out)
        return 1
    return status


async def _checkpoint_then_kill(
    coordinator: CheckpointCoordinator,
    provider: LocalProvider,
    scratch: Path,
    view: FleetView,
    missed: list[str],
) -> None:
    """Checkpoint, then kill the host with the most parked episodes; why it could not, in
    ``missed`` (the demo then fails: it has not shown what it is for)."""
    dispatcher = coordinator.dispatcher
    await trio.sleep(CHECKPOINT_AT_S)
    try:
        manifest = await coordinator.checkpoint(scratch / "ckpt-1")
    except CheckpointUnavailable as failure:
        missed.append(f"the checkpoint was unavailable: {failure}")
        return view.say(missed[-1])
    parked = {host.instance: len(host.episodes) for host in manifest.hosts if host.episodes}
    view.say(
        f"checkpoint {manifest.checkpoint_id}: parked episodes exported per host "
        + (", ".join(f"{name} {count}" for name, count in sorted(parked.items())) or "none")
    )
    victim = max(sorted(parked), key=lambda name: parked[name], default=None)
    await trio.sleep(0.3)
    running = dispatcher.hosts.get(victim) if victim is not None else None
    pid = provider.host_pid(running.handle) if running is not None else None
    if victim is None or pid is None:
        missed.append("no host with parked episodes was left to kill (the episodes ended first)")
        return view.say(missed[-1])
    os.kill(pid, signal.SIGKILL)
    view.say(f"SIGKILL {victim} (pid {pid}), {parked[victim]} of its episodes in the checkpoint")
    heir = await dispatcher.scheduler.until_lost(victim)
    view.say(
        f"{victim} lost; {heir} took its place: {dispatcher.recovered_total} episode(s) "
        "restored there from the checkpoint, the rest of its work runs there afresh"
    )


async def _summary(
    groups: dict[str, list[dict[str, Any]]],
    consumed: list[SealedResult],
    recovered: int,
    hosts_now: list[str],
    elapsed_s: float,
    out: TextIO,
) -> int:
    expected = {(g, s) for g, examples in groups.items() for s in range(len(examples))}
    counted = Counter((r.group_id, r.sibling) for r in consumed)
    twice = sorted(key for key, n in counted.items() if n > 1)
    missing = sorted(expected - set(counted))
    same_effects = 0
    runner = ExampleRunner()
    for result in consumed:
        example = groups[result.group_id][result.sibling]
        alone = await runner.run_example({**example, "think_s": 0}, ExampleContext("alone", 0))
        same_effects += result.error is None and result.result["booked"] == alone["booked"]
    from_checkpoint = sum(1 for r in consumed if r.attempt > 0)
    afresh = sum(1 for r in consumed if ".g" in r.rollout_id)
    print("\nSummary", file=out)
    print(f"  episodes                    {len(expected)}", file=out)
    print(f"  consumed                    {len(consumed)}", file=out)
    print(f"  consumed twice              {len(twice)}", file=out)
    print(f"  never consumed              {len(missing)}", file=out)
    print(f"  continued from checkpoint   {from_checkpoint} (restored on the heir: {recovered})",
          file=out)  # fmt: skip
    print(f"  run afresh after the loss   {afresh}", file=out)
    print(f"  side effects as one run     {same_effects} of {len(consumed)}", file=out)
    print(f"  hosts at the end            {', '.join(hosts_now)}", file=out)
    print(f"  wall time                   {elapsed_s:.1f} s", file=out)
    exact = not twice and not missing and same_effects == len(consumed) == len(expected)
    print(f"\n  every episode exactly once: {'yes' if exact else 'NO'}", file=out)
    return 0 if exact else 1
