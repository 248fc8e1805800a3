"""A small trainer, run as its own process by the crash tests: ``python -m tests.trainer_process
'<json>'``.

It restores the newest checkpoint under ``root`` (or starts afresh), then trains step after step:
each step runs its groups, takes a checkpoint while their episodes are in flight, and finishes
them. What it consumed travels in the checkpoint as the trainer's state. It can kill itself with
SIGKILL at a named point of its n-th checkpoint (``before_prepare``, ``mid_commit``,
``mid_drain``, ``after_manifest``), or be killed from outside. Events go to stdout as JSON lines.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import trio

import trio_gym.trainer.coordinator as coordinator_module
from trio_gym.trainer.control import HostControl
from trio_gym.trainer.coordinator import CheckpointCoordinator, CheckpointSettings
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.dispatch import Dispatcher, SealedResult
from trio_gym.trainer.host_client import ClientSettings, HostClient
from trio_gym.trainer.hosts import HostHandle
from trio_gym.trainer.manifest import MANIFEST_NAME, load_manifest
from trio_gym.trainer.scheduler import RemoteHost

KILL_POINTS = ("before_prepare", "mid_commit", "mid_drain", "after_manifest")


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def die(point: str) -> None:
    emit("killed", point=point)
    os.kill(os.getpid(), signal.SIGKILL)


def group_examples(group_id: str, siblings: int, think_s: float) -> list[dict[str, Any]]:
    """A group's payloads, the same in every process (the trainer's data is deterministic)."""
    step, index = (int(part[1:]) for part in group_id.split("-"))
    return [
        {"seed": 1000 * step + 10 * index + j, "meetings": 3, "think_s": think_s}
        for j in range(siblings)
    ]


class Armed:
    """Where to die: a kill point of this process's ``nth`` checkpoint (``none``: never)."""

    def __init__(self, point: str, nth: int) -> None:
        self.point, self.nth = point, nth
        self.checkpoints = 0

    def at(self, point: str) -> None:
        if self.point == point and self.checkpoints == self.nth:
            die(point)

    def install(self) -> None:
        drain, write_manifest = coordinator_module.drain, coordinator_module.write_manifest

        async def drain_then_die(*args: Any, **kwargs: Any) -> None:
            self.at("mid_drain")
            await drain(*args, **kwargs)

        def write_then_die(*args: Any, **kwargs: Any) -> Path:
            path = write_manifest(*args, **kwargs)
            self.at("after_manifest")
            return path

        coordinator_module.drain = drain_then_die  # type: ignore[assignment]
        coordinator_module.write_manifest = write_then_die  # type: ignore[assignment]


class ArmedControl(HostControl):
    def __init__(self, url: str, token: str, armed: Armed) -> None:
        super().__init__(url, token)
        self.armed = armed

    async def prepare(self, checkpoint_id: str, **kwargs: Any) -> dict[str, Any]:
        self.armed.at("before_prepare")
        return await super().prepare(checkpoint_id, **kwargs)

    async def commit(self, checkpoint_id: str, directory: str, **kwargs: Any) -> dict[str, Any]:
        reply = await super().commit(checkpoint_id, directory, **kwargs)
        self.armed.at("mid_commit")  # this host committed; another may still be committing
        return reply


async def submit_late(dispatcher: Dispatcher, group_id: str, siblings: int, think_s: float) -> None:
    """A group sent just after the checkpoint began: its attempts wait at the closed gate (the
    hosts take longer than this to park), so the checkpoint's ledger holds them RESERVED."""
    await trio.sleep(0.02)
    await dispatcher.run_group(group_id, group_examples(group_id, siblings, think_s))


def newest_checkpoint(root: Path) -> Path | None:
    found = [
        (load_manifest(path.parent).trainer_state["n"], path.parent)
        for path in root.glob(f"*/{MANIFEST_NAME}")
    ]
    return max(found)[1] if found else None


async def main(config: dict[str, Any]) -> None:
    root = Path(config["root"])
    armed = Armed(config.get("kill", "none"), config.get("kill_at_checkpoint", 1))
    armed.install()
    deadlines = DeadlineRegistry()
    hosts = [
        RemoteHost(
            HostHandle(name, url, control_token=config["token"]),
            HostClient(url, ClientSettings(request_deadline_s=60), deadlines=deadlines),
            ArmedControl(url, config["token"], armed),
        )
        for name, url in sorted(config["hosts"].items())
    ]
    consumed: list[list[Any]] = []

    def consume(sealed: SealedResult) -> None:
        consumed.append(
            [
                sealed.group_id,
                sealed.sibling,
                sealed.rollout_id,
                sealed.attempt,
                sealed.host,
                sealed.result["booked"],
                sealed.result["reward"],
                sealed.result["_ng_attempt_index"],
            ]
        )

    state: dict[str, Any] = {"step": 0, "n": 0}
    dispatcher = Dispatcher(hosts, consume, deadlines=deadlines)
    coordinator = CheckpointCoordinator(
        dispatcher,
        settings=CheckpointSettings(control_timeout_s=10, lease_s=30),
        trainer_state=lambda: {**state, "consumed": list(consumed)},
    )
    async with dispatcher:
        source = newest_checkpoint(root)
        if source is None:
            await coordinator.take_over()
            emit("started")
        else:
            restored = await coordinator.restore(source)
            state = {"step": restored.trainer_state["step"], "n": restored.trainer_state["n"]}
            consumed.extend(restored.trainer_state["consumed"])
            emit("restored", source=source.name, restored=restored.restored)
        siblings, think_s = config["siblings"], config["think_s"]
        while state["step"] < config["steps"]:
            step = state["step"]
            groups = [f"s{step}-g{i}" for i in range(config["groups"])]
            late = f"s{step}-g{config['groups']}"  # submitted while the checkpoint holds the gate
            async with trio.open_nursery() as nursery:
                for group_id in groups:
                    examples = group_examples(group_id, siblings, think_s)
                    nursery.start_soon(dispatcher.run_group, group_id, examples)
                await trio.sleep(config["checkpoint_after_s"])
                nursery.start_soon(submit_late, dispatcher, late, siblings, think_s)
                state["n"] += 1
                armed.checkpoints += 1
                directory = root / f"ckpt-{state['n']}-{uuid.uuid4().hex[:8]}"
                manifest = await coordinator.checkpoint(directory)
                exported = [key for host in manifest.hosts for key in host.episodes]
                emit("checkpoint", n=state["n"], directory=directory.name, exported=exported)
            state["step"] += 1
        emit("done", consumed=consumed)


if __name__ == "__main__":
    trio.run(main, json.loads(sys.argv[1]))
