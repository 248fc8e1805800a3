"""One batch spread over several hosts, carried on without the hosts that fail.

A :class:`HostPool` (``async with HostPool(hosts) as pool: await pool.run(examples)``) splits a
batch into chunks (``chunk_size``) and sends each through its
:class:`~trio_gym.trainer.scheduler.Scheduler` — a slot on the least loaded healthy host,
``per_host_in_flight`` each; the results come back in input order.
:class:`~trio_gym.trainer.client.RolloutClient` is a pool of its one host. What happens to a
chunk whose send failed is the error's ``reach``, decided where the client built it (the table
in :mod:`trio_gym.trainer.host_client`):

- **Unreached** — no host took it: it goes back, first in line, and the next free slot sends
  it, at most ``max_unreached_sends`` times.
- **Taken** — the host took it and the answer failed or was cut: the chunk fails, named. It is
  never sent again under the same identity: the host may be running it still. (Checkpoint-aware
  callers re-send such work as a new attempt through
  :class:`~trio_gym.trainer.dispatch.Dispatcher`.)
- **Refused** — the host's answer for that chunk, and the chunk's result.

Which hosts are healthy, and the probing, ejection and replacement of the others, are the
scheduler's; when no host is left, every chunk still waiting fails, naming how each host ended.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

import attrs
import trio

from trio_gym.errors import raise_unwrapped
from trio_gym.http import HttpLimits, StreamOpener, open_tcp
from trio_gym.logs import log_event
from trio_gym.trainer.errors import Reach, RolloutError
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.hosts import HostHandle, Launcher
from trio_gym.trainer.metrics import FleetStats
from trio_gym.trainer.scheduler import Member, RemoteHost, Scheduler, SchedulerSettings


class Progress(Protocol):
    """What a progress display hears; every method is called from the client's trio tasks."""

    def chunk_started(self, chunk: int, attempt: int, size: int) -> None: ...
    def heartbeat(self, chunk: int) -> None: ...
    def chunk_finished(self, chunk: int, results: Sequence[Any]) -> None: ...
    def chunk_failed(self, chunk: int, error: RolloutError) -> None: ...


class SilentProgress:
    def chunk_started(self, chunk: int, attempt: int, size: int) -> None:
        pass

    def heartbeat(self, chunk: int) -> None:
        pass

    def chunk_finished(self, chunk: int, results: Sequence[Any]) -> None:
        pass

    def chunk_failed(self, chunk: int, error: RolloutError) -> None:
        pass


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
    """One ``run``'s chunks and an answer each."""

    def __init__(
        self,
        examples: Sequence[Mapping[str, Any]],
        size: int,
        on_answer: Callable[[ChunkAnswered], None] | None,
    ) -> None:
        self.size = size
        self.chunks = [examples[i : i + size] for i in range(0, len(examples), size)]
        self.answers: list[list[Any] | RolloutError | None] = [None] * len(self.chunks)
        self._on_answer = on_answer

    def answer(
        self,
        index: int,
        answer: list[Any] | RolloutError,
        host: str | None = None,
        elapsed_s: float | None = None,
    ) -> None:
        self.answers[index] = answer
        if self._on_answer is not None:
            self._on_answer(ChunkAnswered(index * self.size, self.outcomes(index), host, elapsed_s))

    def outcomes(self, index: int) -> list[Any]:
        """Each example of chunk ``index``: its result, or the chunk's error."""
        answer = self.answers[index]
        assert answer is not None
        return answer if isinstance(answer, list) else [answer] * len(self.chunks[index])

    def failures(self) -> list[RolloutError]:
        return [answer for answer in self.answers if isinstance(answer, RolloutError)]


class HostPool:
    """Runs batches over several hosts; async, trio-only, used as ``async with pool:``.

    Inside the block the scheduler keeps the hosts (probing, ejecting and replacing them) —
    between batches too, so a host that failed at the end of one batch is dealt with before
    the next. Several tasks may run batches at once; ``progress`` hears every batch's chunks.

    ``launcher`` (a provider) lets the scheduler ask whether a host's process is alive and
    replace a lost one. ``client_settings`` are each request's (``chunk_size``, the timeouts,
    ``host_deadline_s``, ``failures``, the size limits); ``max_in_flight``, ``max_attempts``
    and ``backoff_s`` are a one-host client's, here ``settings`` say it.
    """

    def __init__(
        self,
        hosts: Sequence[HostHandle],
        settings: SchedulerSettings | None = None,
        *,
        client_settings: ClientSettings | None = None,
        launcher: Launcher | None = None,
        progress: Progress | None = None,
        limits: HttpLimits | None = None,
        opener: StreamOpener = open_tcp,
        stats: FleetStats | None = None,
    ) -> None:
        self.client_settings = client_settings or ClientSettings()
        connect = partial(
            RemoteHost.launched, settings=self.client_settings, limits=limits, opener=opener
        )
        self.scheduler = Scheduler(
            [connect(handle) for handle in hosts],
            settings,
            launcher=launcher,
            connect=connect,
            stats=stats,
        )
        self.stats = self.scheduler.stats
        """What it counts (:mod:`trio_gym.trainer.metrics`; pass one to share it)."""
        self.progress: Progress = progress or SilentProgress()

    async def __aenter__(self) -> HostPool:
        await self.scheduler.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self.scheduler.__aexit__(*exc_info)

    @property
    def hosts(self) -> list[HostHandle]:
        """The hosts work goes to now (replacements included, lost ones not)."""
        return [host.handle for host in self.scheduler.hosts.values()]

    @property
    def ejected(self) -> dict[str, str]:
        """Every host lost, with why."""
        return self.scheduler.ejected

    async def run(self, examples: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Run ``examples``; one result per example, in input order.

        Raises ``ValueError`` for an empty batch and :class:`RolloutError` if any chunk failed
        (the message counts the failed chunks and carries the first failure's cause); any other
        exception is a bug in this process and propagates as itself. :meth:`outcomes` keeps the
        chunks that succeeded.
        """
        batch = await self._run_batch(examples, None)
        if failures := batch.failures():
            raise batch_failure(failures, len(batch.answers))
        return [result for index in range(len(batch.chunks)) for result in batch.outcomes(index)]

    async def outcomes(
        self,
        examples: Sequence[Mapping[str, Any]],
        *,
        on_answer: Callable[[ChunkAnswered], None] | None = None,
    ) -> list[Any]:
        """Run ``examples``; for each, in input order, its result (a failure record, with
        ``failures="records"``) or the :class:`RolloutError` its chunk failed with. Every
        example is answered exactly once; ``on_answer`` hears each chunk's answer as it comes
        (completion order). Cancelled, it cuts the requests it has in flight (their hosts then
        cancel those examples) and sends nothing more."""
        batch = await self._run_batch(examples, on_answer)
        return [outcome for index in range(len(batch.chunks)) for outcome in batch.outcomes(index)]

    async def _run_batch(
        self,
        examples: Sequence[Mapping[str, Any]],
        on_answer: Callable[[ChunkAnswered], None] | None,
    ) -> _Batch:
        if not examples:
            raise ValueError("an empty batch has nothing to run; pass at least one example")
        batch = _Batch(examples, self.client_settings.chunk_size, on_answer)
        try:
            async with trio.open_nursery() as nursery:
                for index in range(len(batch.chunks)):
                    # ``start`` returns once the chunk holds a slot: chunks go out in order.
                    await nursery.start(self._run_chunk, batch, index)
        except ExceptionGroup as group:
            raise_unwrapped(group)  # a bug in one chunk's task, as itself
        return batch

    async def _run_chunk(
        self,
        batch: _Batch,
        index: int,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Send chunk ``index`` until a host answers it, it is taken, or it runs out of sends."""
        limit = self.scheduler.settings.max_unreached_sends
        started = False
        send = 0
        error: RolloutError | None = None
        host: str | None = None
        while True:
            send += 1
            try:
                async with self.scheduler.slot(first=send > 1) as member:
                    if not started:
                        task_status.started()
                        started = True
                    error = await self._send(member, batch, index, send)
            except RolloutError as refusal:  # no host is left, or the pool closed
                final = refusal.renamed(f"chunk {index + 1} was not run: {refusal.message}")
                if error is not None:  # its own last send says more than the hosts' ends
                    final = error.renamed(
                        f"{final.message}; its last send, to {host}: {error.message}"
                    )
                host = None
                break
            if error is None:
                return
            host = member.name
            if error.reach is not Reach.UNREACHED:
                final = error.renamed(f"chunk {index + 1} failed on host {host}: {error.message}")
                break
            if send >= limit:
                final = error.renamed(
                    f"chunk {index + 1} was not taken by any host in {send} sends; the last, "
                    f"to {host}: {error.message}"
                )
                break
            self.stats.chunks_requeued += 1
            log_event("chunk_requeued", chunk=index, host=host, error=str(error))
        if not started:
            task_status.started()
        self.stats.chunks_failed[final.origin.value] += 1
        batch.answer(index, final, host)
        self.progress.chunk_failed(index, final)

    async def _send(
        self, member: Member, batch: _Batch, index: int, send: int
    ) -> RolloutError | None:
        """One send of chunk ``index``; the error, reported to the scheduler, if it failed."""
        chunk = batch.chunks[index]
        log_event("chunk_sending", chunk=index, host=member.name, send=send)
        self.progress.chunk_started(index, send, len(chunk))
        sent = trio.current_time()
        self.stats.chunks_sent += 1
        self.stats.chunks_in_flight += 1
        try:
            results = await member.host.client.post(
                chunk,
                row_offset=index * batch.size,
                on_heartbeat=partial(self.progress.heartbeat, index),
            )
        except RolloutError as error:
            self.scheduler.failed(member, error)
            return error
        finally:
            self.stats.chunks_in_flight -= 1
        self.stats.chunks_answered += 1
        self.scheduler.succeeded(member)
        batch.answer(index, results, member.name, trio.current_time() - sent)
        self.progress.chunk_finished(index, results)
        return None


def batch_failure(failures: list[RolloutError], chunks: int) -> RolloutError:
    """One error for a batch whose ``failures`` (of ``chunks``) failed: counted, the first's
    cause carried."""
    first = failures[0]
    summary = f"{len(failures)} of {chunks} rollout chunk(s) failed"
    if len(failures) == chunks > 1:
        summary += "; every chunk failed, so the host itself is the likelier cause"
    return first.renamed(f"{summary}. First: {first.message}")
