"""Gym's own finalization of every record, by a worker process the host owns.

NeMo Gym's collection finishes each record after its ``/run`` returns (model-call capture,
trajectory, ``ng_perf``, token capture and masks) and clears a row's old captures before it is
dispatched; the formats are Gym's, large and versioned. So Gym's own functions do it, in the
Python that has ``nemo_gym`` (which need not be the host's): :mod:`.finalize_worker`, run by
that Python, spoken to over its standard input and output, one JSON line a request.

:class:`RecordFinalizer` owns the worker as a task of its owner's nursery (``run``): started and
configured with Gym's global config before the host is ready, started again if it exits (its
standard error is logged, and its last lines name a death), stopped with the host. Requests are
written by one writer task in the order they come (a caller cancelled meanwhile can never cut a
line in half) and answered in that order, one at a time. The bound (``call_timeout_s``) is on
the worker's progress: while requests wait, it must answer one every ``call_timeout_s`` — a
worker that does not is killed, started again, and every request it had been given fails
naming why; a long queue behind a healthy worker is no failure. So no call hangs, and a row
whose record cannot be finished fails, never passed off as finished. Snapshots to retire are
handed to a task of the finalizer and sent in batches: delivery never waits on the worker.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import subprocess
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import trio

from trio_gym.changes import Changes
from trio_gym.http import encode_json
from trio_gym.logs import log_event
from trio_gym.processes.output import OutputTail

from .base import FinalizationCounts
from .deployment import AgentError

WORKER: Final = Path(__file__).with_name("finalize_worker.py")
# Starting a worker imports Gym's collection (about 5 s on these machines; more on busy cores).
START_TIMEOUT_S: Final = 180.0
# How long a stopping worker gets after its standard input closes before it is killed, and how
# long a killed one is waited for (a process in an uninterruptible wait is then left behind).
STOP_GRACE_S: Final = 5.0
# A worker that dies within QUICK_END_S of its start is started again after a pause growing by
# RESTART_BACKOFF_S for each such death in a row, at most MAX_RESTART_BACKOFF_S.
RESTART_BACKOFF_S: Final = 0.5
MAX_RESTART_BACKOFF_S: Final = 10.0
QUICK_END_S: Final = 10.0
# Snapshots retired in one request at most.
RETIRE_BATCH: Final = 256
# Never handed to the worker: Gym's code has no business with the host's control plane.
WITHHELD_VARIABLES: Final = ("NMP_CONTROL_TOKEN",)
REFUSED: Final = "Gym's finalizer refused: "
# Gym's global config switches for what finalization adds, as Gym's collection reads them.
OBSERVABILITY_KEY: Final = "observability_enabled"
TOKEN_CAPTURE_KEY: Final = "token_id_capture"


class FinalizeFailed(AgentError):
    """A record could not be finished (or a capture cleared) by Gym's code; the message says why."""


class FinalizationUnavailable(Exception):
    """Records cannot be finalized here for this deployment; the message says why."""


def capture_switches(config: Mapping[str, Any]) -> list[str]:
    """The switches of Gym's global config that make its collection finalize records: the
    model-call capture (``observability_enabled``) and token-ID capture
    (``token_id_capture.enabled``). None on: Gym's collection adds nothing either."""
    switches = []
    if config.get(OBSERVABILITY_KEY) is True:
        switches.append(OBSERVABILITY_KEY)
    block = config.get(TOKEN_CAPTURE_KEY)
    if isinstance(block, Mapping) and block.get("enabled") is True:
        switches.append(f"{TOKEN_CAPTURE_KEY}.enabled")
    return switches


@attrs.frozen
class Retirement:
    """A frozen token snapshot Gym lets go of once its record is delivered."""

    rollout_id: str
    snapshot_id: str
    version: int


@attrs.frozen
class FinishedRecord:
    record: dict[str, Any]
    retirement: Retirement | None


class WorkerProcess(Protocol):
    """What the finalizer needs of a started worker (a :class:`trio.Process`)."""

    stdin: trio.abc.SendStream | None
    stdout: trio.abc.ReceiveStream | None
    stderr: trio.abc.ReceiveStream | None

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


StartWorker = Callable[[], Awaitable[WorkerProcess]]


def worker_starter(python: str, environ: Mapping[str, str] | None = None) -> StartWorker:
    """Start :mod:`.finalize_worker` with ``python`` (by its file, ``-P``: nothing beside it on
    ``sys.path``), in the host's environment without the control token."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items()}
    for name in WITHHELD_VARIABLES:
        env.pop(name, None)
    env["PYTHONUNBUFFERED"] = "1"

    async def start() -> WorkerProcess:
        process: WorkerProcess = await trio.lowlevel.open_process(
            [python, "-P", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        return process

    return start


async def stop_worker(process: WorkerProcess) -> None:
    """Close its standard input (a worker exits at end-of-file), kill it after
    :data:`STOP_GRACE_S`, and wait as long again; a process that is not gone even then (an
    uninterruptible wait) is left, said so: the host's stop is bounded."""
    if process.stdin is not None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await process.stdin.aclose()
    with trio.move_on_after(STOP_GRACE_S):
        await process.wait()
        return
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    with trio.move_on_after(STOP_GRACE_S):
        await process.wait()
        return
    log_event("finalizer_unkillable", level=logging.ERROR, waited_s=2 * STOP_GRACE_S)


@attrs.define(eq=False)
class _Call:
    line: bytes
    done: trio.Event = attrs.field(factory=trio.Event)
    answer: dict[str, Any] | None = None
    failure: str | None = None


class _Worker:
    """One started worker: its requests to write, those in flight, and how it ended."""

    def __init__(self, process: WorkerProcess, max_line_bytes: int) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.stderr = OutputTail("gym-finalizer")
        self.max_line_bytes = max_line_bytes
        self.calls: dict[int, _Call] = {}
        """Requests given to it and not answered, by id, in the order they were given."""
        self.ended: str | None = None
        self.gone = trio.Event()
        self.exited = False
        """Its process is gone: no request is given to it any more."""
        self._ids = itertools.count(1)
        self._to_write, self._writing = trio.open_memory_channel[int](math.inf)
        self._answers = 0
        self._changes = Changes()
        """Noted when a request is given, answered, or the worker ends."""

    async def call(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """One request and its answer. Raises :class:`FinalizeFailed` for a refusal, or once
        the worker ended (dead, or not answering: its watchdog's bound). Cancelled, the request
        may still be written and carried out — a capture cleared, a record finished — and its
        answer is dropped."""
        if self.ended is not None:
            raise FinalizeFailed(self.ended)
        number = next(self._ids)
        try:
            line = encode_json({"id": number, "op": op, **fields}) + b"\n"
        except (TypeError, ValueError, RecursionError) as exc:
            raise FinalizeFailed(
                f"the record cannot be handed to Gym's finalizer, it is not JSON ({exc}); the "
                "row's /run answered something Gym's collection could not write either"
            ) from exc
        call = self.calls[number] = _Call(line)
        self._note()
        try:
            self._to_write.send_nowait(number)
            await call.done.wait()
        finally:
            self.calls.pop(number, None)
        if call.failure is not None:
            raise FinalizeFailed(call.failure)
        assert call.answer is not None
        if not call.answer.get("ok"):
            raise FinalizeFailed(f"{REFUSED}{call.answer.get('error')}")
        return call.answer

    async def write_requests(self) -> None:
        """Write each request whole, in order; one whose caller is gone is skipped. (The only
        writer: a caller's cancellation never stops a write half-way.)"""
        stdin = self.process.stdin
        assert stdin is not None
        async for number in self._writing:
            call = self.calls.get(number)
            if call is not None:
                try:
                    await stdin.send_all(call.line)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # it is ending: its watcher ends its calls

    async def read_answers(self) -> None:
        """Hand each answer line to its call, until the worker's output ends."""
        stdout = self.process.stdout
        assert stdout is not None
        buffer = bytearray()
        searched = 0
        while data := await stdout.receive_some(65536):
            buffer += data
            while (end := buffer.find(b"\n", searched)) >= 0:
                self._answer(bytes(buffer[:end]))
                del buffer[: end + 1]
                searched = 0
            searched = len(buffer)
            if len(buffer) > self.max_line_bytes:
                log_event("finalizer_answer_too_large", level=logging.ERROR, bytes=len(buffer))
                self.end(f"Gym's finalizer answered more than {self.max_line_bytes} bytes at once")
                self.process.kill()
                return

    def _answer(self, line: bytes) -> None:
        try:
            answer = json.loads(line)
        except (ValueError, RecursionError):
            answer = None
        number = answer.get("id") if isinstance(answer, dict) else None
        if not isinstance(number, int):
            text = line[:200].decode("utf-8", "replace")
            log_event("finalizer_stray_line", level=logging.WARNING, line=text)
            return
        self._answers += 1
        self._note()
        call = self.calls.get(number)
        if call is not None:  # else its caller was cancelled meanwhile
            call.answer = answer
            call.done.set()

    async def watch_progress(self, bound_s: float) -> None:
        """While requests wait, one must be answered every ``bound_s``; else the worker is
        ended (its requests fail) and killed."""
        while self.ended is None:
            if not self.calls:
                await self._changes.wait()
                continue
            answered = self._answers
            with trio.move_on_after(bound_s):
                while self._answers == answered and self.ended is None:
                    await self._changes.wait()
                continue
            self.end(
                f"Gym's finalizer answered nothing for {bound_s:g} s with {len(self.calls)} "
                "request(s) waiting (NMP_GYM_FINALIZE_TIMEOUT_S); it was stopped, and is "
                "started again"
            )
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    def _note(self) -> None:
        self._changes.note()

    def end(self, why: str) -> None:
        """The worker is gone: every request it was given fails, naming why (the first why)."""
        if self.ended is None:
            self.ended = why
            self.gone.set()
            self._note()
        for call in self.calls.values():
            if not call.done.is_set():
                call.failure = self.ended
                call.done.set()


class RecordFinalizer:
    """Finishes records with Gym's own code, in a worker it keeps running (see the module)."""

    def __init__(
        self,
        config: Mapping[str, Any],
        start_worker: StartWorker,
        *,
        call_timeout_s: float,
        max_line_bytes: int,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.config = dict(config)
        self.start_worker = start_worker
        self.call_timeout_s = call_timeout_s
        self.max_line_bytes = max_line_bytes
        """The longest answer taken (a record is at most what an answer may carry)."""
        self.start_timeout_s = start_timeout_s
        self.finalizes: list[str] = []
        """What Gym's config switches on, as the last worker configured said."""
        self._configured = False
        self._worker: _Worker | None = None
        self._worker_changes = Changes()
        self._last_end = "it has not started yet"
        self.counts = FinalizationCounts()
        self._retire_in, self._retire_out = trio.open_memory_channel[Retirement](math.inf)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start a worker and configure it, report started, then keep one running until
        cancelled — and send the retirements handed over meanwhile. A worker that ends is
        started again, after a pause that grows while they keep ending soon. Raises
        :class:`FinalizationUnavailable` if the first cannot be started or configured; a later
        one that cannot is tried again, calls meanwhile failing at their bound with the reason.
        Once started it never raises (but ``Cancelled``): whatever a worker does, the host
        outlives it."""
        unavailable: FinalizationUnavailable | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_retirements)
            try:
                await self._keep_guarded(task_status)
            except FinalizationUnavailable as exc:
                unavailable = exc
                nursery.cancel_scope.cancel()
            else:
                await self._keep_starting()
        if unavailable is not None:
            raise unavailable

    async def _keep_starting(self) -> None:
        quick_ends = 1
        while True:
            pause = min(RESTART_BACKOFF_S * quick_ends, MAX_RESTART_BACKOFF_S)
            log_event(
                "finalizer_restarting", level=logging.WARNING, why=self._last_end, after_s=pause
            )
            await trio.sleep(pause)
            started = trio.current_time()
            try:
                await self._keep_guarded(trio.TASK_STATUS_IGNORED)
            except FinalizationUnavailable as exc:
                self._last_end = f"Gym's finalizer could not be started again: {exc}"
            quick = trio.current_time() - started < QUICK_END_S
            quick_ends = quick_ends + 1 if quick else 1

    async def _keep_guarded(self, task_status: trio.TaskStatus[None]) -> None:
        """:meth:`_keep_one`; once a worker has been configured, a failure of ours in keeping
        it (a bug) is logged, not raised: a worker's bytes must not end the host."""
        try:
            await self._keep_one(task_status)
        except FinalizationUnavailable:
            raise
        except Exception:
            if not self._configured:
                raise
            log_event("finalizer_failed", level=logging.ERROR, exc_info=True)

    async def _keep_one(self, task_status: trio.TaskStatus[None]) -> None:
        """One worker from start to end: configured, used until it exits, then stopped.
        Raises :class:`FinalizationUnavailable` if it cannot be started or configured."""
        try:
            process = await self.start_worker()
        except OSError as exc:
            raise FinalizationUnavailable(
                f"cannot start Gym's finalizer: {exc}; check --gym-python (NMP_GYM_PYTHON)"
            ) from exc
        worker = _Worker(process, self.max_line_bytes)
        refused: FinalizationUnavailable | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, worker)
                try:
                    await self._configure(worker)
                except FinalizationUnavailable as exc:
                    refused = exc
                else:
                    nursery.start_soon(worker.watch_progress, self.call_timeout_s)
                    self._use(worker)
                    task_status.started()
                    await worker.gone.wait()
                nursery.cancel_scope.cancel()
        finally:
            if self._worker is worker:
                self._use(None)
            worker.end(self._death(worker, "was stopped"))
            self._last_end = worker.ended or self._last_end
            with trio.CancelScope(shield=True):
                await stop_worker(process)
        if refused is not None:
            raise refused

    async def _watch(self, worker: _Worker) -> None:
        """Write its requests, read its answers and its standard error; once it exits (and
        the last of its output is in, within a second), end it."""
        process = worker.process
        async with trio.open_nursery() as writing:
            writing.start_soon(worker.write_requests)
            async with trio.open_nursery() as output:
                output.start_soon(worker.read_answers)
                if process.stderr is not None:
                    output.start_soon(worker.stderr.pump, "stderr", process.stderr)
                status = await process.wait()
                worker.exited = True  # given nothing more, while the last of its output comes in
                if self._worker is worker:
                    self._use(None)
                output.cancel_scope.deadline = trio.current_time() + 1.0
            writing.cancel_scope.cancel()
        worker.end(self._death(worker, f"exited with status {status}"))

    def _death(self, worker: _Worker, how: str) -> str:
        tail = worker.stderr.text()
        return f"Gym's finalizer {how}" + (f"; the end of its output:\n{tail}" if tail else "")

    async def _configure(self, worker: _Worker) -> None:
        with trio.move_on_after(self.start_timeout_s):
            try:
                answer = await worker.call("configure", {"config": self.config})
            except FinalizeFailed as exc:
                raise FinalizationUnavailable(str(exc).removeprefix(REFUSED)) from exc
            self.finalizes = [str(part) for part in answer.get("finalizes", [])]
            self._configured = True
            log_event("finalizer_ready", finalizes=self.finalizes)
            return
        raise FinalizationUnavailable(
            f"Gym's finalizer was not ready within {self.start_timeout_s:g} s (importing "
            "nemo_gym takes seconds; a Gym Python that hangs at start is the likelier cause)"
        )

    def _use(self, worker: _Worker | None) -> None:
        self._worker = worker
        self._worker_changes.note()

    async def _call(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """A request to the worker running now, waiting for one being started within
        ``call_timeout_s``; its answer then comes within the worker's bound. Raises
        :class:`FinalizeFailed` saying why not."""
        self.counts.calls[op] += 1
        try:
            return await self._call_worker(op, fields)
        except FinalizeFailed:
            self.counts.failures[op] += 1
            raise

    async def _call_worker(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        with trio.move_on_after(self.call_timeout_s) as waiting:
            while (worker := self._worker) is None or worker.exited or worker.ended is not None:
                await self._worker_changes.wait()
        if waiting.cancelled_caught:
            raise FinalizeFailed(
                f"no Gym finalizer was running within {self.call_timeout_s:g} s "
                f"(NMP_GYM_FINALIZE_TIMEOUT_S); the last one: {self._last_end}"
            )
        assert worker is not None
        return await worker.call(op, fields)

    async def prepare(self, row: Mapping[str, Any]) -> None:
        """Clear the old captures of the row's capture key, before its ``/run``. (Cancelled,
        they may be cleared all the same.)"""
        await self._call("prepare", {"row": row})

    async def finish(
        self, row: Mapping[str, Any], record: Mapping[str, Any], latency_ms: float | None
    ) -> FinishedRecord:
        """The record as Gym's collection finishes it (and what to retire once delivered).
        (Cancelled, Gym may have frozen its token snapshot; it is kept, as a record never
        delivered keeps it.)"""
        answer = await self._call(
            "finish", {"row": row, "record": record, "latency_ms": latency_ms}
        )
        finished, retire = answer.get("record"), answer.get("retire")
        try:
            if not isinstance(finished, dict):
                raise TypeError("no record")  # noqa: TRY301 - one refusal for every bad shape
            retirement = None
            if retire is not None:
                retirement = Retirement(
                    str(retire["rollout_id"]), str(retire["snapshot_id"]), int(retire["version"])
                )
        except (KeyError, TypeError, ValueError) as exc:
            self.counts.failures["finish"] += 1
            raise FinalizeFailed(
                f"Gym's finalizer answered something that is not a finished record "
                f"({str(answer)[:200]}); is its finalize_worker.py from this trio_gym?"
            ) from exc
        return FinishedRecord(finished, retirement)

    def retire(self, retirement: Retirement) -> None:
        """Let Gym drop the token snapshot of a record that has been delivered: handed to the
        finalizer's own task, sent in batches, never waited for (a retire that fails keeps the
        snapshot, and says so in the log)."""
        self._retire_in.send_nowait(retirement)

    async def _send_retirements(self) -> None:
        async for first in self._retire_out:
            batch = [first]
            while len(batch) < RETIRE_BATCH:
                try:
                    batch.append(self._retire_out.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                await self._call("retire", {"retire": [attrs.asdict(r) for r in batch]})
            except FinalizeFailed as exc:
                log_event(
                    "token_snapshots_kept",
                    level=logging.WARNING,
                    rollouts=[r.rollout_id for r in batch],
                    reason=str(exc),
                )
