"""The one scheduler every trainer-side runner sends through: which host, how many at once, and
what becomes of a host that fails.

A :class:`Scheduler` (``async with Scheduler(hosts) as scheduler:``) holds its hosts' slots.
``async with scheduler.slot() as member:`` waits for a slot on the least loaded healthy host (or,
with ``slot(name)``, on that host: an episode restored from a checkpoint runs only where its
export is) and sends through ``member.host``; the sender then reports what happened with
:meth:`Scheduler.succeeded` or :meth:`Scheduler.failed`. Waiters get slots first come, first
served; ``slot(first=True)`` puts work that has waited longest (an unreached re-send) in front.

Health, decided here for every caller:

- A failure that makes a host *suspect* (:attr:`RolloutError.suspect`: it may be gone) stops new
  sends to it until a probe of ``/health`` says ``ready``. A stranger at its address
  (``wrong_host``) or a launcher that says its process is gone *ejects* it at once;
  ``max_host_failures`` failures with nothing completed between them eject it too. A busy host
  is alive: probed again, not counted.
- An ejected host is *lost*: with a launcher it is replaced (at most ``max_replacements`` times);
  without one, or when replacing fails, the least loaded host left is its heir. ``on_lost``
  hears (lost host, heir) before anyone sends to the heir, so a dispatcher can move the lost
  host's work there first (and restore its episodes from the last checkpoint). A sender waiting
  on the lost host is told by :class:`HostLost`, naming the heir.
- When no host is left, every waiter gets the :class:`RolloutError` that says how each ended.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from trio_gym.changes import Changes
from trio_gym.errors import raise_unwrapped
from trio_gym.http import HttpLimits, StreamOpener, open_tcp
from trio_gym.logs import log_event
from trio_gym.trainer.control import HostControl
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.errors import Origin, Reach, RolloutError
from trio_gym.trainer.host_client import ClientSettings, HostClient
from trio_gym.trainer.hosts import HealthStatus, HostHandle, Launcher, LaunchFailed, probe
from trio_gym.trainer.metrics import FleetStats


@attrs.frozen
class RemoteHost:
    """One host as a scheduler sends to it: its handle, its rollout client, its control plane."""

    handle: HostHandle
    client: HostClient
    control: HostControl

    @property
    def name(self) -> str:
        return self.handle.name

    @classmethod
    def connect(
        cls, name: str, url: str, token: str = "", *, settings: ClientSettings | None = None
    ) -> RemoteHost:
        """A host known by its name, URL and control token."""
        return cls.launched(HostHandle(name, url, control_token=token), settings=settings)

    @classmethod
    def launched(
        cls,
        handle: HostHandle,
        *,
        settings: ClientSettings | None = None,
        deadlines: DeadlineRegistry | None = None,
        limits: HttpLimits | None = None,
        opener: StreamOpener = open_tcp,
    ) -> RemoteHost:
        """A host a provider launched (or one known by URL): its requests and control calls
        carry the handle's headers (a platform's proxy may want its own) and identity."""
        client = HostClient(
            handle.url, settings, deadlines=deadlines, limits=limits, headers=handle.headers,
            identity=handle.identity, opener=opener,
        )  # fmt: skip
        control = HostControl(
            handle.url,
            handle.control_token,
            name=handle.name,
            headers=handle.request_headers(),
            opener=opener,
        )
        return cls(handle, client, control)


Connect = Callable[[HostHandle], RemoteHost]
"""How a replacement's handle becomes a host to send to."""
OnLost = Callable[[RemoteHost, "RemoteHost | None"], Awaitable[None]]
"""Hears a lost host and its heir (``None``: no host is left) before the heir takes work."""


@attrs.frozen
class SchedulerSettings:
    """How a scheduler spreads work and when it gives up on a host."""

    per_host_in_flight: int = 4
    max_host_failures: int = 3
    """Failed requests and failed probes, with nothing completed between them, that eject."""
    probe_timeout_s: float = 5.0
    probe_interval_s: float = 1.0
    max_unreached_sends: int = 8
    """Sends a piece of work no host took may have; the last one's refusal is its failure."""
    max_replacements: int | None = None
    """Ejected hosts replaced over the scheduler's life; ``None``: as many as it started with."""

    def __attrs_post_init__(self) -> None:
        for name in ("per_host_in_flight", "max_host_failures", "max_unreached_sends"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


class HostLost(Exception):
    """The named host was lost; ``heir`` (a host's name, or ``None`` when none is left) holds
    its work now."""

    def __init__(self, lost: str, heir: str | None) -> None:
        then = f"{heir} took its place" if heir else "no host is left to take its work"
        super().__init__(f"host {lost} was lost; {then}")
        self.lost, self.heir = lost, heir


@attrs.define(eq=False)
class Member:
    """One host's place in the scheduler."""

    host: RemoteHost
    in_flight: int = 0
    failures: int = 0
    suspect: bool = False
    """It failed a request: no new sends until a probe says ready."""
    ejected: str | None = None
    """Why it is out."""
    last_error: RolloutError | None = None
    heir: Member | None = None
    settled: bool = False
    """Lost and its work handed on (to ``heir``, or to no one)."""
    trouble: trio.Event = attrs.field(factory=trio.Event)
    """Set when it turns suspect or is ejected: its keeper wakes."""

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def healthy(self) -> bool:
        return not self.suspect and self.ejected is None


@attrs.define(eq=False)
class _Waiter:
    host: str | None
    granted: Member | None = None
    refusal: Exception | None = None
    event: trio.Event = attrs.field(factory=trio.Event)


class Scheduler:
    """Slots on healthy hosts, and the probing, ejection and replacement of the others; used as
    ``async with scheduler:`` (its keepers, one task per host place, live in that block)."""

    def __init__(
        self,
        hosts: Sequence[RemoteHost],
        settings: SchedulerSettings | None = None,
        *,
        launcher: Launcher | None = None,
        connect: Connect | None = None,
        on_lost: OnLost | None = None,
        stats: FleetStats | None = None,
    ) -> None:
        if not hosts:
            raise ValueError("a scheduler needs at least one host")
        if len({host.name for host in hosts}) != len(hosts):
            raise ValueError(f"host names must differ: {[host.name for host in hosts]}")
        if launcher is not None and connect is None:
            raise ValueError("a launcher's replacements need `connect` to become hosts")
        self.settings = settings or SchedulerSettings()
        self.launcher = launcher
        self.on_lost = on_lost
        self._connect = connect
        self._places = [Member(host) for host in hosts]
        self._known = {member.name: member for member in self._places}
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._changes = Changes()
        self._replacements_left = (
            len(hosts) if self.settings.max_replacements is None else self.settings.max_replacements
        )
        self._places_left = len(hosts)
        """Places whose keeper still runs: a host may yet serve there."""
        self.stats = stats or FleetStats()
        self._open = False
        self._context: contextlib.AbstractAsyncContextManager[Scheduler] | None = None

    async def __aenter__(self) -> Scheduler:
        if self._context is not None:
            raise RuntimeError("this scheduler is already open")
        self._context = self._running()
        return await self._context.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._context is not None
        try:
            return await self._context.__aexit__(*exc_info)
        finally:
            self._context = None

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[Scheduler]:
        try:
            async with trio.open_nursery() as nursery:
                self._open = True
                self._count_hosts()
                for place in range(len(self._places)):
                    nursery.start_soon(self._keep, place)
                try:
                    yield self
                finally:
                    self._open = False
                    self.stats.hosts.pop(self, None)  # a closed scheduler has no hosts to show
                    nursery.cancel_scope.cancel()
                    self._refuse_all(
                        RolloutError(
                            "the scheduler was closed first",
                            origin=Origin.CLIENT,
                            reach=Reach.UNREACHED,
                        )
                    )
        except ExceptionGroup as group:
            raise_unwrapped(group)

    # --- what callers see -------------------------------------------------------------------

    @property
    def hosts(self) -> dict[str, RemoteHost]:
        """The hosts in service now, by name (replacements included, lost ones not)."""
        return {m.name: m.host for m in self._places if m.ejected is None}

    @property
    def ejected(self) -> dict[str, str]:
        """Every host lost and not replaced, with why."""
        return {m.name: m.ejected for m in self._places if m.ejected is not None}

    def healthy(self) -> list[str]:
        """The hosts that take work now."""
        return [m.name for m in self._places if m.healthy]

    @property
    def unsettled(self) -> list[str]:
        """Hosts lost whose work is not yet handed on (a replacement is being launched)."""
        return [name for name, m in self._known.items() if m.ejected and not m.settled]

    def heir_of(self, name: str) -> str | None:
        """Where ``name``'s work goes now: itself while in service, else its heir's heir..."""
        member: Member | None = self._known.get(name)
        if member is None:
            return name  # a host this scheduler never had (a restore's): its own
        while member is not None and member.ejected is not None:
            member = member.heir
        return None if member is None else member.name

    @contextlib.asynccontextmanager
    async def slot(self, host: str | None = None, *, first: bool = False) -> AsyncIterator[Member]:
        """Hold a slot on ``host`` (or on the least loaded healthy host) for one send.

        Raises :class:`HostLost` when ``host`` is lost (after its work was handed on), and the
        :class:`RolloutError` of a scheduler with no host left (or closed)."""
        if not self._open:
            raise RuntimeError("send inside `async with scheduler:`")
        if host is not None and host not in self._known:
            raise ValueError(f"no host {host!r} in this scheduler (it has {sorted(self._known)})")
        waiter = _Waiter(host)
        if first:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        answered = False
        try:
            self._grant()
            await waiter.event.wait()
            answered = True
        finally:
            if not answered:  # cancelled while waiting (a slot granted meanwhile is given back)
                if waiter.event.is_set():
                    self._give_back(waiter)
                else:
                    self._waiters.remove(waiter)
        if waiter.refusal is not None:
            raise waiter.refusal
        member = waiter.granted
        assert member is not None
        try:
            yield member
        finally:
            self._give_back(waiter)

    def _give_back(self, waiter: _Waiter) -> None:
        if waiter.granted is not None:
            waiter.granted.in_flight -= 1
            waiter.granted = None
            self._grant()

    def succeeded(self, member: Member) -> None:
        """A send to ``member`` was answered: its failure count starts again."""
        member.failures = 0

    def failed(self, member: Member, error: RolloutError) -> None:
        """A send to ``member`` failed with ``error``; a suspect one is probed before more."""
        if not error.suspect:
            return
        member.failures += 1
        member.last_error = error
        if not member.suspect:
            member.suspect = True
            member.trouble.set()
            log_event("host_suspect", level=logging.WARNING, host=member.name, error=str(error))
            self._changed_now()

    def suspect(self, name: str, why: str) -> None:
        """Something other than a send found host ``name`` unresponsive (a checkpoint's
        control call): it is probed like a host that failed a send."""
        member = self._known.get(name)
        if member is not None and member.ejected is None:
            self.failed(
                member, RolloutError(why, origin=Origin.PROXY, reach=Reach.REFUSED, suspect=True)
            )

    async def until_lost(self, name: str) -> str | None:
        """Wait until host ``name`` is lost and its work handed on; its heir."""
        member = self._known[name]
        await self._changes.until(lambda: member.settled)
        return member.heir.name if member.heir else None

    async def until_handed_on(self) -> None:
        """Wait until every lost host's work is on its heir (no replacement is starting)."""
        await self._changes.until(lambda: not self.unsettled)

    async def until_settled(self, member: Member) -> None:
        """Wait until ``member`` is healthy again, or lost and its work handed on (then
        :class:`HostLost`): what a sender whose answer was cut waits for before it decides."""
        while True:
            if member.settled:
                raise HostLost(member.name, member.heir.name if member.heir else None)
            if member.healthy:
                return
            await self._changes.wait()

    # --- slots ------------------------------------------------------------------------------

    def _grant(self) -> None:
        """Give free slots to waiters in order; tell those waiting for a lost host."""
        if not self._waiters:
            return
        for waiter in list(self._waiters):
            if waiter.host is None:
                member = self._least_loaded()
                if member is None and self._places_left == 0:
                    waiter.refusal = self._no_host_left()
            else:
                named = self._known[waiter.host]
                member = named if named.healthy and self._free(named) else None
                if named.settled:
                    waiter.refusal = HostLost(named.name, named.heir.name if named.heir else None)
            if waiter.refusal is None and member is None:
                continue
            if waiter.refusal is None:
                assert member is not None
                member.in_flight += 1
                waiter.granted = member
            self._waiters.remove(waiter)
            waiter.event.set()

    def _free(self, member: Member) -> bool:
        return member.in_flight < self.settings.per_host_in_flight

    def _least_loaded(self) -> Member | None:
        free = [m for m in self._places if m.healthy and self._free(m)]
        return min(free, key=lambda m: m.in_flight, default=None)

    def _changed_now(self) -> None:
        self._count_hosts()
        self._changes.note()
        self._grant()

    def _count_hosts(self) -> None:
        counted: collections.Counter[str] = collections.Counter()
        for member in self._known.values():
            if member.ejected is not None:
                counted["lost" if member.settled else "replacing"] += 1
            else:
                counted["suspect" if member.suspect else "healthy"] += 1
        if self._open:
            self.stats.hosts[self] = counted

    def _refuse_all(self, error: RolloutError) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            waiter.refusal = error
            waiter.event.set()

    def _no_host_left(self) -> RolloutError:
        ends = "; ".join(f"{name}: {why}" for name, why in self.ejected.items())
        causes = [m.last_error for m in self._known.values() if m.last_error is not None]
        origin = causes[-1].origin if causes else Origin.PROXY
        return RolloutError(
            f"no host is left ({ends}); give the scheduler more hosts, or a launcher to replace "
            "those it loses (max_replacements)",
            origin=origin,
            reach=Reach.UNREACHED,
        )

    # --- health -----------------------------------------------------------------------------

    async def _keep(self, place: int) -> None:
        """The ``place``-th host: waits while it is healthy, probes it when suspect, hands its
        work on once ejected; the place is gone when no replacement can be had."""
        while True:
            member = self._places[place]
            if member.ejected is not None:
                if not await self._hand_on(place):
                    break
            elif member.suspect:
                await self._probe(member)
            else:
                await member.trouble.wait()
                member.trouble = trio.Event()
        self._places_left -= 1
        self._changed_now()

    async def _probe(self, member: Member) -> None:
        """Probe a suspect host until it is ready again or ejected."""
        settings = self.settings
        while True:
            if self.launcher is not None and not await self.launcher.alive(member.host.handle):
                return self._eject(member, "its process is gone")
            if member.failures >= settings.max_host_failures:
                cause = member.last_error.message if member.last_error else "no answer"
                return self._eject(member, f"{member.failures} failures in a row; last: {cause}")
            client = member.host.client
            health = await probe(
                member.host.handle,
                timeout_s=settings.probe_timeout_s,
                opener=client.opener,
                limits=client.limits,
            )
            if health.status is HealthStatus.READY:
                member.suspect = False
                log_event("host_ready_again", host=member.name)
                return self._changed_now()
            if health.status is HealthStatus.WRONG_HOST:
                return self._eject(
                    member, f"its address now answers for another host: {health.detail}"
                )
            if health.status is not HealthStatus.BUSY:  # busy is alive and full: not a failure
                member.failures += 1
                member.last_error = RolloutError(
                    f"GET /health: {health.detail}", origin=Origin.SANDBOX, reach=Reach.REFUSED
                )
                if member.failures >= settings.max_host_failures:
                    continue  # ejected at the top, without another pause
            await trio.sleep(settings.probe_interval_s)

    def _eject(self, member: Member, why: str) -> None:
        member.ejected = why
        self.stats.ejections += 1
        log_event("host_ejected", level=logging.WARNING, host=member.name, why=why)
        self._changed_now()

    async def _hand_on(self, place: int) -> bool:
        """Replace the lost host in ``place`` (or name the least loaded host left its heir),
        let ``on_lost`` move its work, then wake who waited for it; whether the place lives."""
        lost = self._places[place]
        replacement = await self._replacement(lost)
        heir = replacement
        if heir is None:
            alive = [m for m in self._places if m.ejected is None]
            heir = min(alive, key=lambda m: m.in_flight, default=None)
        if replacement is not None:
            self._places[place] = replacement
            self._known[replacement.name] = replacement
        if self.on_lost is not None:
            await self.on_lost(lost.host, heir.host if heir is not None else None)
        lost.heir, lost.settled = heir, True
        log_event("host_lost", host=lost.name, heir=heir.name if heir else None)
        self._changed_now()
        return replacement is not None

    async def _replacement(self, lost: Member) -> Member | None:
        """A new host for ``lost``'s place through the launcher, ready; ``None`` if none."""
        if self.launcher is None or self._replacements_left == 0:
            return None
        assert self._connect is not None
        self._replacements_left -= 1
        try:
            handle = await self.launcher.replace(lost.host.handle)
        except LaunchFailed as exc:
            self.stats.replacements_failed += 1
            lost.ejected = f"{lost.ejected}; its replacement failed: {exc}"
            log_event("host_replace_failed", level=logging.WARNING, host=lost.name, error=str(exc))
            return None
        self.stats.replacements += 1
        log_event("host_replaced", host=lost.name, by=handle.name)
        return Member(self._connect(handle))
