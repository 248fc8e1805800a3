"""In-process hosts for trainer-side tests on a virtual clock: a dispatcher over memory streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from tests.helpers import CountingRunner
from tests.streams import socket_like_pair
from trio_gym.config import ServeConfig
from trio_gym.host import Host, handle_connection
from trio_gym.runners import ExampleContext, ExampleRunner, Runner
from trio_gym.trainer.client import ClientSettings, RolloutClient
from trio_gym.trainer.control import HostControl
from trio_gym.trainer.coordinator import CheckpointCoordinator, CheckpointSettings
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.dispatch import Dispatcher, DispatchSettings, RemoteHost, SealedResult

EPOCH = 1_800_000_000.0
TOKEN = "fleet-token"


def wall() -> float:
    return EPOCH + trio.current_time()


class CuttableStream(trio.abc.Stream):
    """The trainer's end of a connection; once ``cut`` is set, reading from it fails as a dead
    proxy would, while the host's end stays open (the host may keep running the batch). While
    ``muted``, nothing the host sends arrives (a proxy that holds the answer)."""

    def __init__(self, inner: trio.abc.Stream, cut: trio.Event, muted: bool = False) -> None:
        self._inner, self._cut, self._muted = inner, cut, muted

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._cut.is_set():
            raise trio.BrokenResourceError("the proxy dropped the connection")
        if self._muted:
            await self._cut.wait()
            raise trio.BrokenResourceError("the proxy dropped the connection")
        async with trio.open_nursery() as nursery:
            received: list[bytes | bytearray] = []

            async def read() -> None:
                received.append(await self._inner.receive_some(max_bytes))
                nursery.cancel_scope.cancel()

            async def watch() -> None:
                await self._cut.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(read)
            nursery.start_soon(watch)
        if not received:
            raise trio.BrokenResourceError("the proxy dropped the connection")
        return received[0]

    async def aclose(self) -> None:
        if not self._cut.is_set():  # a cut connection stays open at the host, as behind a proxy
            await self._inner.aclose()


@attrs.define
class Fleet:
    hosts: dict[str, Host]
    runners: dict[str, CountingRunner]
    dispatcher: Dispatcher
    coordinator: CheckpointCoordinator
    consumed: list[SealedResult]
    nursery: trio.Nursery
    cuts: dict[str, list[trio.Event]]
    """Host -> one event per connection the trainer opened to it (set one to cut it)."""
    mutes: dict[str, list[bool]]
    """Host -> whether each next connection is muted (popped as connections open)."""
    opened: dict[str, list[float]]
    """Host -> when (trio time) the trainer opened each connection to it."""


def crash(f: Fleet) -> None:
    """The trainer process dies; its connections stay open at the hosts (as behind a proxy
    that has not noticed), so the hosts keep running what it sent."""
    for cuts in f.cuts.values():
        for cut in cuts:
            cut.set()


@asynccontextmanager
async def fleet(
    names: tuple[str, ...] = ("a", "b"),
    *,
    client: ClientSettings | None = None,
    dispatch: DispatchSettings | None = None,
    checkpoint: CheckpointSettings | None = None,
    on_result: Callable[[SealedResult], None] | None = None,
    runners: Mapping[str, Runner] | None = None,
) -> AsyncIterator[Fleet]:
    """Hosts ``names`` (each the example environment unless ``runners`` names another)."""
    consumed: list[SealedResult] = []
    deadlines = DeadlineRegistry()
    async with trio.open_nursery() as nursery:
        hosts: dict[str, Host] = {}
        counting: dict[str, CountingRunner] = {}
        handles = []
        cuts: dict[str, list[trio.Event]] = {}
        mutes: dict[str, list[bool]] = {}
        opened: dict[str, list[float]] = {}
        for name in names:
            runner = counting[name] = CountingRunner((runners or {}).get(name, ExampleRunner()))
            config = ServeConfig(port=0, control_token=TOKEN, rollout_deadline_s=10**6)
            host = hosts[name] = Host(config, runner=runner, wall_time=wall)
            nursery.start_soon(host.checkpoints.watch_lease)
            cuts[name], mutes[name], opened[name] = [], [], []
            opener = _opener(nursery, host, cuts[name], mutes[name], opened[name])
            url = f"http://{name}.invalid:8080"
            settings = client or ClientSettings(request_deadline_s=10**7)
            handles.append(
                RemoteHost(
                    name,
                    RolloutClient(url, settings, opener=opener, deadlines=deadlines),
                    HostControl(
                        url, TOKEN, opener=_opener(nursery, host, [], [], []), wall_time=wall
                    ),
                )
            )
        dispatcher = Dispatcher(
            handles, on_result or consumed.append, settings=dispatch, deadlines=deadlines
        )
        coordinator = CheckpointCoordinator(
            dispatcher,
            settings=checkpoint,
            trainer_state=lambda: {"consumed": [attrs.asdict(r) for r in consumed]},
        )
        yield Fleet(
            hosts, counting, dispatcher, coordinator, consumed, nursery, cuts, mutes, opened
        )
        nursery.cancel_scope.cancel()


def _opener(
    nursery: trio.Nursery,
    host: Host,
    cuts: list[trio.Event],
    mutes: list[bool],
    opened: list[float],
) -> Any:
    async def open_stream(endpoint: Any) -> trio.abc.Stream:
        opened.append(trio.current_time())
        trainer_end, host_end = socket_like_pair()
        nursery.start_soon(handle_connection, host, host_end)
        cut = trio.Event()
        cuts.append(cut)
        return CuttableStream(trainer_end, cut, muted=mutes.pop(0) if mutes else False)

    return open_stream


def calendar(seed: int, *, think_s: float = 5.0, meetings: int = 3) -> dict[str, Any]:
    return {"seed": seed, "meetings": meetings, "think_s": think_s}


async def uninterrupted(example: dict[str, Any]) -> dict[str, Any]:
    """What an episode yields when nothing interrupts it (its side effects exactly once)."""
    result = await ExampleRunner().run_example({**example, "think_s": 0}, ExampleContext("x", 0))
    return result  # type: ignore[no-any-return]
