"""In-process hosts for trainer-side tests on a virtual clock: a dispatcher over memory streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from tests.helpers import CountingRunner
from trio_gym.config import ServeConfig
from trio_gym.host import Host, handle_connection
from trio_gym.runners import ExampleContext, ExampleRunner, Runner
from trio_gym.trainer.control import HostControl
from trio_gym.trainer.coordinator import CheckpointCoordinator, CheckpointSettings
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.dispatch import Dispatcher, DispatchSettings, SealedResult
from trio_gym.trainer.host_client import ClientSettings, HostClient
from trio_gym.trainer.hosts import HostHandle
from trio_gym.trainer.scheduler import RemoteHost, SchedulerSettings

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
    world: World

    def kill(self, name: str) -> None:
        """Host ``name``'s process dies: everything it runs stops, its connections break and
        nothing connects to it again."""
        self.world.kill(name)


def crash(f: Fleet) -> None:
    """The trainer process dies; its connections stay open at the hosts (as behind a proxy
    that has not noticed), so the hosts keep running what it sent, and it opens no connection
    again (no goodbye reaches a host) until :func:`restart`."""
    f.world.severed = True
    for cuts in f.cuts.values():
        for cut in cuts:
            cut.set()


def restart(f: Fleet) -> None:
    """A new trainer process: it connects again."""
    f.world.severed = False


class World:
    """In-process hosts, each living in a scope of its own (its "process"), reached by URL, and
    a launcher (:class:`~trio_gym.trainer.hosts.Launcher`) that replaces a dead one."""

    def __init__(
        self, nursery: trio.Nursery, runners: Mapping[str, Runner], replacement: Runner | None
    ) -> None:
        self.nursery, self.runner_of, self.replacement = nursery, runners, replacement
        self.hosts: dict[str, Host] = {}
        self.runners: dict[str, CountingRunner] = {}
        self.cuts: dict[str, list[trio.Event]] = {}
        self.mutes: dict[str, list[bool]] = {}
        self.opened: dict[str, list[float]] = {}
        self.lives: dict[str, trio.Nursery] = {}
        self.dead: set[str] = set()
        self.severed = False
        """The trainer is dead: nothing it does reaches a host."""
        self.replaced: list[tuple[str, str]] = []

    async def start(self, name: str, runner: Runner) -> None:
        counting = self.runners[name] = CountingRunner(runner)
        config = ServeConfig(port=0, control_token=TOKEN, rollout_deadline_s=10**6)
        host = self.hosts[name] = Host(config, runner=counting, wall_time=wall)
        self.cuts[name], self.mutes[name], self.opened[name] = [], [], []
        self.lives[name] = await self.nursery.start(self._live, host)

    async def _live(self, host: Host, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as life:
            life.start_soon(host.services.checkpoints.watch_lease)
            task_status.started(life)
            await trio.sleep_forever()

    def kill(self, name: str) -> None:
        self.dead.add(name)
        self.lives[name].cancel_scope.cancel()
        for cut in self.cuts[name]:
            cut.set()

    def opener(self, name: str | None = None, *, recorded: bool = True) -> Any:
        """Connections to host ``name`` (or to whichever host the URL names)."""

        async def open_stream(endpoint: Any) -> trio.abc.Stream:
            target = name or endpoint.host.removesuffix(".invalid")
            await trio.lowlevel.checkpoint()
            if target in self.dead or self.severed:
                raise ConnectionRefusedError(111, "Connection refused")
            trainer_end, host_end = trio.testing.memory_stream_pair()
            self.lives[target].start_soon(handle_connection, self.hosts[target], host_end)
            cut = trio.Event()
            muted = False
            if recorded:
                self.opened[target].append(trio.current_time())
                self.cuts[target].append(cut)
                muted = self.mutes[target].pop(0) if self.mutes[target] else False
            return CuttableStream(trainer_end, cut, muted=muted)

        return open_stream

    async def alive(self, handle: HostHandle) -> bool:
        return handle.name not in self.dead

    async def replace(self, handle: HostHandle) -> HostHandle:
        if handle.name not in self.dead:
            self.kill(handle.name)
        new = f"{handle.name}-r{len(self.replaced) + 1}"
        await self.start(new, self.replacement or ExampleRunner())
        self.replaced.append((handle.name, new))
        return HostHandle(new, url_of(new), control_token=TOKEN)


def url_of(name: str) -> str:
    return f"http://{name}.invalid:8080"


@asynccontextmanager
async def fleet(
    names: tuple[str, ...] = ("a", "b"),
    *,
    client: ClientSettings | None = None,
    dispatch: DispatchSettings | None = None,
    checkpoint: CheckpointSettings | None = None,
    on_result: Callable[[SealedResult], None] | None = None,
    runners: Mapping[str, Runner] | None = None,
    controls: Mapping[str, Callable[..., HostControl]] | None = None,
    replaceable: bool = False,
    scheduler: SchedulerSettings | None = None,
) -> AsyncIterator[Fleet]:
    """Hosts ``names`` (each the example environment unless ``runners`` names another; each
    control client a :class:`HostControl` unless ``controls`` names another class); with
    ``replaceable``, a lost host is replaced by a new one (``<name>-r<n>``)."""
    consumed: list[SealedResult] = []
    deadlines = DeadlineRegistry()
    settings = client or ClientSettings(request_deadline_s=10**7)
    async with trio.open_nursery() as nursery:
        world = World(nursery, runners or {}, None)

        def connect(handle: HostHandle) -> RemoteHost:
            url, name = handle.url, handle.name
            return RemoteHost(
                handle,
                HostClient(url, settings, opener=world.opener(name), deadlines=deadlines),
                (controls or {}).get(name, HostControl)(
                    url, TOKEN, name=name, opener=world.opener(name, recorded=False), wall_time=wall
                ),
            )

        handles = []
        for name in names:
            await world.start(name, (runners or {}).get(name, ExampleRunner()))
            handles.append(connect(HostHandle(name, url_of(name), control_token=TOKEN)))
        dispatcher = Dispatcher(
            handles,
            on_result or consumed.append,
            settings=dispatch,
            deadlines=deadlines,
            scheduler=scheduler,
            launcher=world if replaceable else None,
            connect=connect,
        )
        coordinator = CheckpointCoordinator(
            dispatcher,
            settings=checkpoint,
            trainer_state=lambda: {"consumed": [attrs.asdict(r) for r in consumed]},
        )
        async with dispatcher:
            yield Fleet(
                world.hosts,
                world.runners,
                dispatcher,
                coordinator,
                consumed,
                nursery,
                world.cuts,
                world.mutes,
                world.opened,
                world,
            )
        nursery.cancel_scope.cancel()


def calendar(seed: int, *, think_s: float = 5.0, meetings: int = 3) -> dict[str, Any]:
    return {"seed": seed, "meetings": meetings, "think_s": think_s}


async def uninterrupted(example: dict[str, Any]) -> dict[str, Any]:
    """What an episode yields when nothing interrupts it (its side effects exactly once)."""
    result = await ExampleRunner().run_example({**example, "think_s": 0}, ExampleContext("x", 0))
    return result  # type: ignore[no-any-return]
