"""A host with the checkpoint control plane on, on a virtual clock over in-memory streams: its
control client and rollout client, and rows streamed in the background."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from tests.helpers import URL, CountingRunner, in_memory, wire
from trio_gym.config import ServeConfig
from trio_gym.host import Host
from trio_gym.runners import ExampleRunner
from trio_gym.trainer import ClientSettings, RolloutClient, RolloutError
from trio_gym.trainer.control import HostControl

EPOCH = 1_800_000_000.0
TOKEN = "s3cret"


def wall() -> float:
    return EPOCH + trio.current_time()


@attrs.define
class Rig:
    host: Host
    runner: CountingRunner
    control: HostControl
    client: RolloutClient
    nursery: trio.Nursery
    rows: dict[str, list[Any]] = attrs.field(factory=dict)
    done: dict[str, trio.Event] = attrs.field(factory=dict)

    def stream_in_background(self, name: str, examples: list[dict[str, Any]]) -> None:
        """Run ``examples`` as a row stream; its rows (and a final error) land in ``rows[name]``."""
        rows = self.rows.setdefault(name, [])
        done = self.done[name] = trio.Event()

        async def consume() -> None:
            try:
                async with self.client.stream(examples) as stream:
                    async for row in stream:
                        rows.append((trio.current_time(), row))
            except RolloutError as exc:
                rows.append((trio.current_time(), exc))
            finally:
                done.set()

        self.nursery.start_soon(consume)

    async def export_one_parked(self, directory: Path) -> Any:
        """Park one episode mid-way ("a", a step every 10 s, prepared at 12 s), commit checkpoint
        ``c1`` to ``directory`` and resume; the commit's reply as plain data."""
        self.stream_in_background("batch", [episode("a", think_s=10)])
        await trio.sleep(12)
        await self.control.prepare("c1", timeout_s=30)
        reply = await self.control.commit("c1", str(directory), timeout_s=30)
        await self.control.resume("c1", timeout_s=5)
        return wire(reply)

    async def finish(self, name: str) -> list[Any]:
        with trio.fail_after(100_000):  # virtual seconds: a guard only
            await self.done[name].wait()
        return self.rows[name]


@asynccontextmanager
async def rig(**config: Any) -> AsyncIterator[Rig]:
    runner = CountingRunner(ExampleRunner())
    config = {"rollout_deadline_s": 10**6, **config}
    host = Host(ServeConfig(port=0, control_token=TOKEN, **config), runner=runner, wall_time=wall)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(host.services.checkpoints.watch_lease)
        opener = in_memory(nursery, host)
        control = HostControl("http://host:1", TOKEN, opener=opener, wall_time=wall)
        client = RolloutClient(URL, ClientSettings(request_deadline_s=10**7), opener=opener)
        yield Rig(host, runner, control, client, nursery)
        nursery.cancel_scope.cancel()


def episode(rollout_id: str, *, think_s: float, meetings: int = 3, **extra: Any) -> dict[str, Any]:
    return {
        "seed": 7,
        "meetings": meetings,
        "think_s": think_s,
        "_ng_rollout_id": rollout_id,
        **extra,
    }
