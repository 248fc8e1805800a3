"""One batch spread over several hosts, carried on without the hosts that fail.

A :class:`HostPool` (``async with HostPool(hosts) as pool: await pool.run(examples)``) splits a
batch into chunks as :class:`~trio_gym.trainer.client.RolloutClient` does and gives each to a
host with a free slot (``per_host_in_flight`` each); the results come
back in input order, as ``RolloutClient.run`` gives them. What happens to a chunk whose host
fails is the error's ``reach``, decided where the client built it (the table in
:mod:`trio_gym.trainer.client`):

- **Unreached** — no host took it (no connection, no response head over HTTP/1.1, the host's
  "not now", a gateway that could not reach the host): the chunk goes back to the queue, first
  in line, and the next host with a free slot runs it.
- **Taken** — the host took it and the answer failed or was cut: the chunk fails, named. It is
  never sent again under the same identity: the host may be running it still. (Checkpoint-aware
  callers re-send such work as a new attempt through
  :class:`~trio_gym.trainer.dispatch.Dispatcher`.)
- **Refused** — the host's answer for that chunk, and the chunk's result.

A host whose failure makes it suspect (an unreached chunk, a cut answer, a gateway's error)
takes no new chunk until it is probed on ``/health``: ``ready`` and it takes work again; a
stranger at its address (``wrong_host``) is ejected at once; anything else counts as a failure,
and ``max_host_failures`` failures without a chunk completed in between *eject* it. A launcher
that says the host's process is gone ejects it at once. With a launcher, an ejected host is
replaced (at most ``max_replacements`` times in the pool's life); without one, or when
replacing fails, its slot is gone. When no host is left, every chunk still queued fails, naming
how each host ended.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import trio

from trio_gym.errors import raise_unwrapped
from trio_gym.http import HttpLimits, StreamOpener, open_tcp
from trio_gym.logs import log_event
from trio_gym.trainer.client import (
    ClientSettings,
    Progress,
    RolloutClient,
    SilentProgress,
    batch_failure,
)
from trio_gym.trainer.errors import Origin, Reach, RolloutError
from trio_gym.trainer.hosts import HealthStatus, HostHandle, Launcher, LaunchFailed, probe


@attrs.frozen
class PoolSettings:
    """How a pool spreads work and when it gives up on a host."""

    per_host_in_flight: int = 4
    max_host_failures: int = 3
    """Failed requests and failed probes, with no chunk completed between them, that eject."""
    probe_timeout_s: float = 5.0
    probe_interval_s: float = 1.0
    max_chunk_sends: int = 8
    """A chunk no host took in this many sends fails with the last refusal."""
    max_replacements: int | None = None
    """Ejected hosts replaced over the pool's life; ``None``: as many as it started with."""

    def __attrs_post_init__(self) -> None:
        for name in ("per_host_in_flight", "max_host_failures", "max_chunk_sends"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


@attrs.define
class _Member:
    handle: HostHandle
    client: RolloutClient
    failures: int = 0
    suspect: bool = False
    """It failed a request: no new chunk until a probe says ready."""
    ejected: str | None = None
    """Why it is out of the pool."""
    last_error: RolloutError | None = None
    in_flight: int = 0
    """Chunks sent to it and not yet answered."""


@attrs.frozen
class ChunkAnswered:
    """One chunk's answer, as it comes (``on_answer``): the index of its first example, each
    example's outcome (its result, or the :class:`RolloutError` of the chunk), the host that
    answered and how long its last send took (``None`` for a chunk no host ran)."""

    first: int
    outcomes: list[Any]
    host: str | None
    elapsed_s: float | None


class _Batch:
    """One ``run``'s chunks: an answer each, and the requests of it in flight."""

    def __init__(
        self,
        examples: Sequence[Mapping[str, Any]],
        size: int,
        on_answer: Callable[[ChunkAnswered], None] | None,
    ) -> None:
        self.size = size
        self.chunks = [examples[i : i + size] for i in range(0, len(examples), size)]
        self.answers: list[list[Any] | RolloutError | None] = [None] * len(self.chunks)
        self.sends = [0] * len(self.chunks)
        self.finished = trio.Event()
        self.abandoned = False
        self.in_flight: set[trio.CancelScope] = set()
        self._on_answer = on_answer
        self._unanswered = len(self.chunks)

    def answer(
        self,
        index: int,
        answer: list[Any] | RolloutError,
        host: str | None = None,
        elapsed_s: float | None = None,
    ) -> None:
        if self.answers[index] is not None:
            return
        self.answers[index] = answer
        self._unanswered -= 1
        if self._on_answer is not None:
            self._on_answer(ChunkAnswered(index * self.size, self.outcomes(index), host, elapsed_s))
        if self._unanswered == 0:
            self.finished.set()

    def outcomes(self, index: int) -> list[Any]:
        """Each example of chunk ``index``: its result, or the chunk's error."""
        answer = self.answers[index]
        assert answer is not None
        return answer if isinstance(answer, list) else [answer] * len(self.chunks[index])

    def unanswered(self) -> list[int]:
        return [index for index, answer in enumerate(self.answers) if answer is None]

    def abandon(self) -> None:
        """Its ``run`` was cancelled: nothing more of it is sent, and what is sent is cut."""
        self.abandoned = True
        for scope in self.in_flight:
            scope.cancel()


class HostPool:
    """Runs batches over several hosts; async, trio-only, used as ``async with pool:``.

    Inside the block each host has a task of the pool's own that sends it chunks while it is
    healthy, probes it when it failed and replaces it once ejected — between batches too, so a
    host that failed at the end of one batch is dealt with before the next. Several tasks may
    run batches at once; ``progress`` hears every batch's chunks.

    ``launcher`` (a provider) lets the pool ask whether a host's process is alive and replace
    an ejected host. ``client_settings`` are each host's client's: ``chunk_size``,
    ``request_deadline_s``, ``idle_timeout_s``, ``host_deadline_s``, ``failures`` and the size
    limits apply;
    the pool, not the client, decides what is sent again (``max_attempts`` and ``max_in_flight``
    are not used).
    """

    def __init__(
        self,
        hosts: Sequence[HostHandle],
        settings: PoolSettings | None = None,
        *,
        client_settings: ClientSettings | None = None,
        launcher: Launcher | None = None,
        progress: Progress | None = None,
        limits: HttpLimits | None = None,
        opener: StreamOpener = open_tcp,
    ) -> None:
        if not hosts:
            raise ValueError("a pool needs at least one host")
        if len({handle.name for handle in hosts}) != len(hosts):
            raise ValueError(f"host names must differ: {[handle.name for handle in hosts]}")
        self.settings = settings or PoolSettings()
        self.client_settings = client_settings or ClientSettings()
        self.launcher = launcher
        self.progress: Progress = progress or SilentProgress()
        self.limits = limits or HttpLimits()
        self.opener = opener
        self._members = [self._member(handle) for handle in hosts]
        self._replacements_left = (
            len(hosts) if self.settings.max_replacements is None else self.settings.max_replacements
        )
        self._queue: collections.deque[tuple[_Batch, int]] = collections.deque()
        self._changed = trio.Event()
        self._batches: set[_Batch] = set()
        self._slots_left = 0
        self._open = False
        self._context: contextlib.AbstractAsyncContextManager[HostPool] | None = None

    async def __aenter__(self) -> HostPool:
        if self._context is not None:
            raise RuntimeError("this pool is already open")
        self._context = self._running()
        return await self._context.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._context is not None
        try:
            return await self._context.__aexit__(*exc_info)
        finally:
            self._context = None

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[HostPool]:
        try:
            async with trio.open_nursery() as nursery:
                self._open = True
                self._slots_left = len(self._members)
                for slot in range(len(self._members)):
                    nursery.start_soon(self._serve, slot)
                try:
                    yield self
                finally:
                    self._open = False
                    nursery.cancel_scope.cancel()
                    closed = RolloutError(
                        "the pool was closed first", origin=Origin.CLIENT, reach=Reach.UNREACHED
                    )
                    self._fail_everything_waiting(closed)
        except ExceptionGroup as group:
            raise_unwrapped(group)

    @property
    def hosts(self) -> list[HostHandle]:
        """The hosts work goes to now (replacements included, ejected ones not)."""
        return [member.handle for member in self._members if member.ejected is None]

    @property
    def ejected(self) -> dict[str, str]:
        """Every host ejected and not replaced, with why."""
        return {m.handle.name: m.ejected for m in self._members if m.ejected is not None}

    async def run(self, examples: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Run ``examples``; one result per example, in input order.

        Raises ``ValueError`` for an empty batch and :class:`RolloutError` if any chunk failed
        (as :meth:`RolloutClient.run`). :meth:`outcomes` keeps the chunks that succeeded.
        """
        batch = await self._run_batch(examples, None)
        failures = [answer for answer in batch.answers if isinstance(answer, RolloutError)]
        if failures:
            raise batch_failure(failures, len(batch.answers))
        return [result for index in range(len(batch.chunks)) for result in batch.outcomes(index)]

    async def outcomes(
        self,
        examples: Sequence[Mapping[str, Any]],
        *,
        on_answer: Callable[[ChunkAnswered], None] | None = None,
    ) -> list[Any]:
        """Run ``examples``; for each, in input order, its result or the :class:`RolloutError`
        its chunk failed with. Every example is answered exactly once; ``on_answer`` hears each
        chunk's answer as it comes (completion order). Cancelled, it cuts the requests it has
        in flight (their hosts then cancel those examples) and sends nothing more."""
        batch = await self._run_batch(examples, on_answer)
        return [outcome for index in range(len(batch.chunks)) for outcome in batch.outcomes(index)]

    async def _run_batch(
        self,
        examples: Sequence[Mapping[str, Any]],
        on_answer: Callable[[ChunkAnswered], None] | None,
    ) -> _Batch:
        if not examples:
            raise ValueError("an empty batch has nothing to run; pass at least one example")
        if not self._open:
            raise RuntimeError("run batches inside `async with pool:`")
        batch = _Batch(examples, self.client_settings.chunk_size, on_answer)
        self._batches.add(batch)
        try:
            if self._slots_left == 0:
                self._fail_waiting(batch, batch.unanswered(), self._no_host_left())
            else:
                self._queue.extend((batch, index) for index in range(len(batch.chunks)))
                self._wake()
            await batch.finished.wait()
        finally:
            self._batches.discard(batch)
            if not batch.finished.is_set():
                batch.abandon()
        return batch

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _take(self, member: _Member) -> tuple[_Batch, int] | None:
        """The next chunk for ``member`` once it is its turn; ``None`` once it may take none
        (it failed)."""
        while not (member.suspect or member.ejected):
            while self._queue and self._turn_of(member):
                batch, index = self._queue.popleft()
                if not batch.abandoned:
                    member.in_flight += 1
                    if self._queue:  # the others' turns changed; nothing to take, no one to wake
                        self._wake()
                    return batch, index
            await self._changed.wait()
        return None

    def _turn_of(self, member: _Member) -> bool:
        """Least loaded first: no other healthy host has fewer chunks in flight (the first
        host's workers would otherwise take every chunk of a small batch)."""
        return not any(
            other.in_flight < member.in_flight
            for other in self._members
            if other is not member and not other.suspect and other.ejected is None
        )

    async def _serve(self, slot: int) -> None:
        """The pool's ``slot``-th host: its workers while it is healthy, a probe when it
        failed, a replacement once ejected; the slot is gone when none can be had."""
        while True:
            member = self._members[slot]
            if member.ejected is not None:
                if not await self._replace(slot):
                    break
            elif member.suspect:
                await self._probe(member)
            else:
                async with trio.open_nursery() as workers:
                    for _ in range(self.settings.per_host_in_flight):
                        workers.start_soon(self._work, member)
        self._slots_left -= 1
        if self._slots_left == 0:
            self._fail_everything_waiting(self._no_host_left())

    async def _work(self, member: _Member) -> None:
        while (taken := await self._take(member)) is not None:
            batch, index = taken
            batch.sends[index] += 1
            chunk = batch.chunks[index]
            log_event(
                "chunk_sending", chunk=index, host=member.handle.name, send=batch.sends[index]
            )
            self.progress.chunk_started(index, batch.sends[index], len(chunk))
            sent = trio.current_time()
            with trio.CancelScope() as request:
                batch.in_flight.add(request)
                try:
                    results = await member.client.post(
                        chunk,
                        row_offset=index * batch.size,
                        on_heartbeat=partial(self.progress.heartbeat, index),
                    )
                except RolloutError as error:
                    self._failed(member, batch, index, error, trio.current_time() - sent)
                else:
                    member.failures = 0
                    batch.answer(index, results, member.handle.name, trio.current_time() - sent)
                    self.progress.chunk_finished(index, results)
                finally:
                    batch.in_flight.discard(request)
                    member.in_flight -= 1
                    if self._queue:  # a freed slot changes turns only while chunks wait
                        self._wake()

    def _failed(
        self, member: _Member, batch: _Batch, index: int, error: RolloutError, elapsed_s: float
    ) -> None:
        name = member.handle.name
        if error.suspect:
            self._suspect(member, error)
        if error.reach is Reach.UNREACHED:
            if batch.sends[index] < self.settings.max_chunk_sends:
                log_event("chunk_requeued", chunk=index, host=name, error=str(error))
                self._queue.appendleft((batch, index))  # first in line: it has waited longest
                self._wake()
                return
            final = error.renamed(
                f"chunk {index + 1} was not taken by any host in {batch.sends[index]} sends; "
                f"the last, to {name}: {error.message}"
            )
        else:
            final = error.renamed(f"chunk {index + 1} failed on host {name}: {error.message}")
        batch.answer(index, final, name, elapsed_s)
        self.progress.chunk_failed(index, final)

    def _suspect(self, member: _Member, error: RolloutError) -> None:
        member.failures += 1
        member.last_error = error
        if not member.suspect:
            member.suspect = True
            log_event(
                "host_suspect", level=logging.WARNING, host=member.handle.name, error=str(error)
            )
            self._wake()  # its idle workers stop waiting for chunks

    async def _probe(self, member: _Member) -> None:
        """Probe a suspect host until it is ready again or ejected."""
        settings = self.settings
        while True:
            if self.launcher is not None and not await self.launcher.alive(member.handle):
                self._eject(member, "its process is gone")
                return
            if member.failures >= settings.max_host_failures:
                cause = member.last_error.message if member.last_error else "no answer"
                self._eject(member, f"{member.failures} failures in a row; last: {cause}")
                return
            health = await probe(
                member.handle, timeout_s=settings.probe_timeout_s, opener=self.opener
            )
            if health.status is HealthStatus.READY:
                member.suspect = False
                log_event("host_ready_again", host=member.handle.name)
                return
            if health.status is HealthStatus.WRONG_HOST:
                self._eject(member, f"its address now answers for another host: {health.detail}")
                return
            if health.status is HealthStatus.BUSY:  # alive, and full: no failure, ask again
                await trio.sleep(settings.probe_interval_s)
                continue
            member.failures += 1
            member.last_error = RolloutError(
                f"GET /health: {health.detail}", origin=Origin.SANDBOX, reach=Reach.REFUSED
            )
            await trio.sleep(settings.probe_interval_s)

    def _eject(self, member: _Member, why: str) -> None:
        member.ejected = why
        log_event("host_ejected", level=logging.WARNING, host=member.handle.name, why=why)

    async def _replace(self, slot: int) -> bool:
        """Put a new host in ``slot`` through the launcher; whether there is one."""
        member = self._members[slot]
        if self.launcher is None or self._replacements_left == 0:
            return False
        self._replacements_left -= 1
        try:
            handle = await self.launcher.replace(member.handle)
        except LaunchFailed as exc:
            member.ejected = f"{member.ejected}; its replacement failed: {exc}"
            log_event(
                "host_replace_failed",
                level=logging.WARNING,
                host=member.handle.name,
                error=str(exc),
            )
            return False
        log_event("host_replaced", host=member.handle.name, by=handle.name)
        self._members[slot] = self._member(handle)
        return True

    def _no_host_left(self) -> RolloutError:
        ends = "; ".join(f"{name}: {why}" for name, why in self.ejected.items())
        causes = [m.last_error for m in self._members if m.last_error is not None]
        origin = causes[-1].origin if causes else Origin.PROXY
        return RolloutError(
            f"no host is left in the pool ({ends})", origin=origin, reach=Reach.UNREACHED
        )

    def _fail_everything_waiting(self, error: RolloutError) -> None:
        """Answer every chunk no host will run now: the pool closed, or no host is left."""
        self._queue.clear()
        for batch in list(self._batches):
            self._fail_waiting(batch, batch.unanswered(), error)

    def _fail_waiting(self, batch: _Batch, indices: list[int], error: RolloutError) -> None:
        for index in indices:
            final = error.renamed(f"chunk {index + 1} was not run: {error.message}")
            batch.answer(index, final)
            self.progress.chunk_failed(index, final)

    def _member(self, handle: HostHandle) -> _Member:
        client = RolloutClient(
            handle.url,
            self.client_settings,
            limits=self.limits,
            opener=self.opener,
            headers=handle.headers,
            identity=handle.identity,
        )
        return _Member(handle, client)
