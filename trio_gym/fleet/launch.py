"""What every provider shares: the spec of the hosts to launch, the provider protocol, and the
wait for a launched host to be ready.

``async with provider.hosts(n, spec) as hosts:`` launches ``n`` hosts, waits until each
``/health`` says ``ready`` and hands back their :class:`~trio_gym.trainer.hosts.HostHandle`\\ s;
leaving the block, however it is left, stops every host the provider launched in it. A host
that fails to start (its ``/health`` says ``failed``, its process ends, or it is not ready in
``ready_timeout_s``) fails the launch with :class:`~trio_gym.trainer.hosts.LaunchFailed`,
naming what was seen and the end of its log; the hosts already up are stopped.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import attrs
import trio

from trio_gym.config import CallerConfig
from trio_gym.errors import raise_unwrapped
from trio_gym.trainer.hosts import HealthStatus, HostHandle, Launcher, LaunchFailed, probe


def _copied(environment: Mapping[str, str]) -> dict[str, str]:
    """A copy of its own: a caller changing its mapping later does not change the spec."""
    return dict(environment)


IDENTITY_VARIABLE = "NMP_HOST_IDENTITY"


def new_identity() -> str:
    """An identity for one launched host: it answers only callers that carry it."""
    return secrets.token_hex(16)


@attrs.frozen
class HostSpec:
    """What every host of a launch is."""

    environment: Mapping[str, str] = attrs.field(factory=dict, converter=_copied)
    """The host's launch environment: the caller config's bootstrap variables, usually."""
    serve_args: tuple[str, ...] = ()
    """Further ``trio-gym serve`` flags, where the provider runs the command itself."""
    control_token: str = attrs.field(default="", repr=False)
    """Turns the host's checkpoint control plane on (``NMP_CONTROL_TOKEN``)."""
    ready_timeout_s: float = 120.0
    stop_grace_s: float = 15.0
    """After SIGTERM, how long a host gets to answer what it has in flight before SIGKILL."""

    @classmethod
    def from_caller(cls, caller: CallerConfig, **fields: object) -> HostSpec:
        """The hosts a trainer's caller config asks for (its bootstrap environment)."""
        return cls(environment=caller.bootstrap_environment(), **fields)  # type: ignore[arg-type]

    def host_environment(self, identity: str = "") -> dict[str, str]:
        """The variables the host process is given (the control token and the host's
        ``identity`` among them)."""
        token = {"NMP_CONTROL_TOKEN": self.control_token} if self.control_token else {}
        named = {IDENTITY_VARIABLE: identity} if identity else {}
        return {**self.environment, **token, **named}


def _absolute_path(_: object, field: attrs.Attribute[str], value: str) -> None:
    if not value.startswith("/") or any(c in value for c in ',"\n\0'):
        raise ValueError(
            f"a mount's {field.name} must be an absolute path without a comma, a quote, a line "
            f"break or NUL (Docker's --mount syntax cannot carry them), not {value!r}"
        )


@attrs.frozen
class Mount:
    """A directory of the machine the platform runs on, seen inside every launched host at
    ``target``: what an operator's image would hold (Gym's Python, prebuilt venvs) or what a
    launch hands in (an environment package). Read-only unless said otherwise."""

    source: str = attrs.field(validator=_absolute_path)
    target: str = attrs.field(validator=_absolute_path)
    read_only: bool = True

    @classmethod
    def same_path(cls, path: str, *, read_only: bool = True) -> Mount:
        """``path`` at the same path inside: a venv's absolute links keep working."""
        return cls(path, path, read_only)


class Provider(Launcher, Protocol):
    """Launches hosts and owns them (see the module docstring); also a pool's launcher."""

    def hosts(self, n: int, spec: HostSpec) -> AbstractAsyncContextManager[list[HostHandle]]: ...


class Launches:
    """What every provider does the same way: one ``hosts()`` block open at a time, each host
    a task of the block's nursery (leaving the block cancels them: each stops its host), hosts
    started concurrently under names of their own (``PREFIX-N``, never reused)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._numbers = itertools.count()
        self._nursery: trio.Nursery | None = None

    def new_name(self) -> str:
        return f"{self.prefix}-{next(self._numbers)}"

    @contextlib.asynccontextmanager
    async def block(self) -> AsyncIterator[None]:
        """The provider's open ``hosts()`` block; its error (or a failed launch's) raised as
        itself, not wrapped in the block's nursery's group."""
        if self._nursery is not None:
            raise RuntimeError("this provider's hosts() block is already open; use another")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    yield
                finally:
                    self._nursery = None
                    nursery.cancel_scope.cancel()  # every host's task stops its host
        except ExceptionGroup as group:
            raise_unwrapped(group, alike=LaunchFailed)

    async def start(
        self, run_host: Callable[..., Awaitable[None]], name: str, *args: Any
    ) -> HostHandle:
        """``run_host(name, *args)`` as a task of the block; its handle once it is ready. A host
        that does not become ready raises :class:`LaunchFailed` as itself (a provider's host
        task keeps a nursery of its own, which wraps it in a group)."""
        if self._nursery is None:
            raise RuntimeError("hosts are launched inside a hosts() block")
        try:
            handle: HostHandle = await self._nursery.start(run_host, name, *args)
        except ExceptionGroup as group:
            raise_unwrapped(group, alike=LaunchFailed)
        return handle

    async def start_many(
        self,
        n: int,
        run_host: Callable[..., Awaitable[None]],
        arguments: Callable[[int], tuple[Any, ...]] = lambda _: (),
    ) -> list[HostHandle]:
        """``n`` hosts started at once; every one's handle, in order, or the launch's failure
        (the hosts already up are stopped with the block)."""
        if n < 1:
            raise ValueError("launch at least one host")
        names = [self.new_name() for _ in range(n)]
        handles: list[HostHandle | None] = [None] * n

        async def launch(index: int) -> None:
            handles[index] = await self.start(run_host, names[index], *arguments(index))

        try:
            async with trio.open_nursery() as launching:
                for index in range(n):
                    launching.start_soon(launch, index)
        except ExceptionGroup as group:
            raise_unwrapped(group, alike=LaunchFailed)
        return [handle for handle in handles if handle is not None]


async def wait_ready(
    name: str,
    *,
    locate: Callable[[], Awaitable[HostHandle | None]],
    ended: Callable[[], Awaitable[str | None]],
    log_tail: Callable[[], Awaitable[str]],
    timeout_s: float,
    poll_interval_s: float,
) -> HostHandle:
    """Poll until the host ``locate`` finds answers ``ready``; its handle.

    ``locate`` gives the handle once the host can be reached (``None`` until then: a port not
    yet chosen); ``ended`` says how the host's process ended, or ``None`` while it runs. Raises
    :class:`LaunchFailed` at once on ``failed`` or an end, and after ``timeout_s`` otherwise.
    """
    last = "no answer yet"
    with trio.move_on_after(timeout_s):
        handle: HostHandle | None = None
        while True:
            if (end := await ended()) is not None:
                raise LaunchFailed(f"host {name} {end} before it was ready; {await log_tail()}")
            handle = handle or await locate()
            if handle is not None:
                health = await probe(handle, timeout_s=max(poll_interval_s, 1.0))
                if health.status is HealthStatus.READY:
                    return handle
                if health.status is HealthStatus.FAILED:
                    raise LaunchFailed(
                        f"host {name} failed to start: {health.detail}; {await log_tail()}"
                    )
                last = health.detail
            await trio.sleep(poll_interval_s)
    raise LaunchFailed(
        f"host {name} was not ready within {timeout_s:g} s (last /health: {last}); "
        f"{await log_tail()}"
    )
