"""Crash and restore of a whole trainer process (SIGKILL) against live hosts, and a seeded loop
that kills it at random points of its checkpoints. Every episode is trained exactly once, every
side effect exists exactly once, restored episodes run as attempt + 1 on their original host.

The loop runs ``TRIO_GYM_KILL_CYCLES`` cycles (6 by default, so ``.ci/run`` stays quick; the full
check is ``TRIO_GYM_KILL_CYCLES=50``), seeded by ``TRIO_GYM_KILL_SEED``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from tests.fleet import uninterrupted
from tests.live import TOKEN, LiveHost, live_hosts
from tests.trainer_process import KILL_POINTS, group_examples, newest_checkpoint
from trio_gym.protocol.identity import capture_key
from trio_gym.trainer.ledger import Ledger
from trio_gym.trainer.manifest import load_manifest

HANG_GUARD_S = 120
SIBLINGS, GROUPS, THINK_S = 2, 2, 0.2


def base_config(hosts: dict[str, LiveHost], root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "hosts": {name: host.url for name, host in hosts.items()},
        "token": TOKEN,
        "root": str(root),
        "steps": 1,
        "groups": GROUPS,
        "siblings": SIBLINGS,
        "think_s": THINK_S,
        "checkpoint_after_s": 0.3,  # every episode is in its second step
        **extra,
    }


async def run_trainer(
    config: dict[str, Any], *, kill_after: str | None = None
) -> tuple[int, list[dict[str, Any]]]:
    """Run one trainer process to its end; with ``kill_after``, SIGKILL it from here as soon as
    it reports that event. Its return code and events."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.trainer_process", json.dumps(config)],
        stdout=subprocess.PIPE,
    )
    events: list[dict[str, Any]] = []
    assert process.stdout is not None
    buffer = b""
    try:
        with trio.fail_after(HANG_GUARD_S):
            while data := await process.stdout.receive_some():
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    events.append(json.loads(line))
                    if events[-1]["event"] == kill_after:
                        process.send_signal(signal.SIGKILL)
            return await process.wait(), events
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def check_consumed(consumed: list[list[Any]], restored: dict[str, str]) -> Counter[Any]:
    """Each entry's side effects exactly once and its reward as an uninterrupted run's; a
    restored episode ran as attempt + 1 on the host that exported it. Counts per episode."""
    for group_id, sibling, rollout_id, attempt, host, booked, reward, reported in consumed:
        expected = await uninterrupted(group_examples(group_id, SIBLINGS, THINK_S)[sibling])
        assert booked == expected["booked"], (group_id, sibling)  # no booking twice or lost
        assert reward == expected["reward"]
        assert reported == attempt
        if attempt > 0:
            assert restored[capture_key(rollout_id, attempt)] == host, (rollout_id, attempt)
    return Counter((group_id, sibling) for group_id, sibling, *_ in consumed)


def exported_by(source: Path) -> dict[str, str]:
    """Capture keys of the attempts a restore of ``source`` dispatches -> their host."""
    manifest = load_manifest(source)
    ledger = Ledger.from_json(manifest.ledger)
    restored = {}
    for host in manifest.hosts:
        for key in host.episodes:
            attempt = ledger.attempt(key)
            restored[capture_key(attempt.rollout_id, attempt.number + 1)] = host.instance
    return restored


def every_episode_of(steps: int) -> Counter[Any]:
    """Each step's groups, and the one more it submits while its checkpoint holds the gate."""
    return Counter(
        {
            (f"s{s}-g{g}", i): 1
            for s in range(steps)
            for g in range(GROUPS + 1)
            for i in range(SIBLINGS)
        }
    )


async def test_a_killed_trainer_restores_and_trains_every_episode_once(tmp_path: Path) -> None:
    async with live_hosts(a="example", b="example") as hosts:
        config = base_config(hosts, tmp_path)
        code, events = await run_trainer(config, kill_after="checkpoint")
        assert code == -signal.SIGKILL
        (checkpoint,) = [e for e in events if e["event"] == "checkpoint"]
        assert checkpoint["exported"]  # episodes were parked in the checkpoint
        source = newest_checkpoint(tmp_path)
        assert source is not None
        code, events = await run_trainer(config)
    assert code == 0, events
    restored_event = next(e for e in events if e["event"] == "restored")
    restored = exported_by(source)
    assert sorted(restored_event["restored"]) == sorted(restored)
    consumed = events[-1]["consumed"]
    assert await check_consumed(consumed, restored) == every_episode_of(1)
    assert {capture_key(e[2], e[3]) for e in consumed if e[3] > 0} == set(restored)


async def test_a_seeded_kill_loop_keeps_every_episode_exactly_once(tmp_path: Path) -> None:
    cycles = int(os.environ.get("TRIO_GYM_KILL_CYCLES", "6"))
    rng = random.Random(int(os.environ.get("TRIO_GYM_KILL_SEED", "2026")))
    points: Counter[str] = Counter()
    async with live_hosts(a="example", b="example") as hosts:
        order = rng.sample(KILL_POINTS, len(KILL_POINTS))  # every point at least once first
        for cycle in range(cycles):
            point = order[cycle] if cycle < len(order) else rng.choice(KILL_POINTS)
            config = base_config(
                hosts, tmp_path, steps=10**6, kill=point, kill_at_checkpoint=rng.randint(1, 3)
            )
            code, events = await run_trainer(config)
            assert code == -signal.SIGKILL, (cycle, point, events)
            assert events[-1] == {"event": "killed", "point": point}
            points[point] += 1
            source = newest_checkpoint(tmp_path)
            if source is not None:  # what a restore would bring back is already exactly once
                saved = load_manifest(source).trainer_state["consumed"]
                counts = await check_consumed(saved, _restored_so_far(tmp_path))
                assert max(counts.values(), default=1) == 1
        source = newest_checkpoint(tmp_path)
        step = load_manifest(source).trainer_state["step"] if source else 0
        code, events = await run_trainer(base_config(hosts, tmp_path, steps=step + 1))
    assert code == 0, events
    consumed = events[-1]["consumed"]
    assert await check_consumed(consumed, _restored_so_far(tmp_path)) == every_episode_of(step + 1)
    assert len(points) == min(cycles, len(KILL_POINTS))


def _restored_so_far(root: Path) -> dict[str, str]:
    """Every attempt any checkpoint under ``root`` could have restored -> its host."""
    restored: dict[str, str] = {}
    for path in root.glob("*/gym_checkpoint.json"):
        restored.update(exported_by(path.parent))
    return restored
