"""Gym's own finalization of every record, by a worker process the host owns.

NeMo Gym's collection finishes each record after its ``/run`` returns (model-call capture,
trajectory, ``ng_perf``, token capture and masks) and clears a row's old captures before it is
dispatched; the formats are Gym's, large and versioned. So Gym's own functions do it, in the
Python that has ``nemo_gym`` (which need not be the host's): :mod:`.finalize_worker`, run by
that Python, spoken to over its standard input and output, one JSON line a request.

:class:`RecordFinalizer` owns the worker as a task of its owner's nursery (``run``): started and
configured with Gym's global config before the host is ready, started again if it exits (its
standard error is logged, and its last lines name a death), stopped with the host. Every call is
bounded (``call_timeout_s``): a worker that does not answer in time is killed and started
again, and the call fails naming why — a row whose record cannot be finished fails, and is never
passed off as finished. Calls are written as they come and answered in order; when a worker
dies, exactly the calls it had been given fail.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import subprocess
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import trio

from trio_gym.http import encode_json
from trio_gym.logs import log_event
from trio_gym.processes.output import OutputTail

from .deployment import AgentError

WORKER: Final = Path(__file__).with_name("finalize_worker.py")
# Starting a worker imports Gym's collection (about 7 s on these machines; more on busy cores).
START_TIMEOUT_S: Final = 180.0
# How long a stopping worker gets after its standard input closes before it is killed.
STOP_GRACE_S: Final = 5.0
# A worker that dies is started again after this, growing by it for each death in a row.
RESTART_BACKOFF_S: Final = 0.5
MAX_RESTART_BACKOFF_S: Final = 10.0
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

    @classmethod
    def from_answer(cls, answer: Any) -> Retirement | None:
        if answer is None:
            return None
        return cls(str(answer["rollout_id"]), str(answer["snapshot_id"]), int(answer["version"]))


@attrs.frozen
class Finished:
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


@attrs.define(eq=False)
class _Call:
    done: trio.Event = attrs.field(factory=trio.Event)
    answer: dict[str, Any] | None = None
    failure: str | None = None


class _Worker:
    """One started worker: its calls in flight, and how it ended."""

    def __init__(self, process: WorkerProcess, max_line_bytes: int) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.stdin = process.stdin
        self.stdout = process.stdout
        self.stderr = OutputTail("gym-finalizer")
        self.max_line_bytes = max_line_bytes
        self.calls: dict[int, _Call] = {}
        self.ended: str | None = None
        self.gone = trio.Event()
        self._ids = itertools.count(1)
        self._writing = trio.Lock()

    async def call(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """One request and its answer; raises :class:`FinalizeFailed` for a refusal or the
        worker's end. (The bound is the caller's.)"""
        if self.ended is not None:
            raise FinalizeFailed(self.ended)
        number = next(self._ids)
        try:
            line = encode_json({"id": number, "op": op, **fields}) + b"\n"
        except (TypeError, ValueError, RecursionError) as exc:
            raise FinalizeFailed(f"the record cannot be handed to Gym's finalizer: {exc}") from exc
        call = self.calls[number] = _Call()
        try:
            # A worker that is ending refuses the write; its reader hears the end and fails this.
            async with self._writing:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.stdin.send_all(line)
            await call.done.wait()
        finally:
            self.calls.pop(number, None)
        if call.failure is not None:
            raise FinalizeFailed(call.failure)
        assert call.answer is not None
        if not call.answer.get("ok"):
            raise FinalizeFailed(f"{REFUSED}{call.answer.get('error')}")
        return call.answer

    async def read_answers(self) -> None:
        """Hand each answer line to its call, until the worker's output ends."""
        buffer = bytearray()
        while data := await self.stdout.receive_some(65536):
            buffer += data
            while (end := buffer.find(b"\n")) >= 0:
                self._answer(bytes(buffer[:end]))
                del buffer[: end + 1]
            if len(buffer) > self.max_line_bytes:
                log_event("finalizer_answer_too_large", level=logging.ERROR, bytes=len(buffer))
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
        call = self.calls.get(number)
        if call is not None:  # else its caller was cancelled meanwhile
            call.answer = answer
            call.done.set()

    def end(self, why: str) -> None:
        """The worker is gone: every call it was given fails, naming why (the first why)."""
        if self.ended is None:
            self.ended = why
            self.gone.set()
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
        start_timeout_s: float = START_TIMEOUT_S,
        max_line_bytes: int = 512 * 1024 * 1024,
    ) -> None:
        self.config = dict(config)
        self.start_worker = start_worker
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_line_bytes = max_line_bytes
        self.finalizes: list[str] | None = None
        """What Gym's config switches on, as the first worker configured said."""
        self.starts = 0
        self._worker: _Worker | None = None
        self._worker_changed = trio.Event()
        self._last_end = "it has not started yet"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start a worker and configure it, report started, then keep one running until
        cancelled: a worker that ends is started again, after a pause that grows while they
        keep ending soon. Raises :class:`FinalizationUnavailable` if the first cannot be started
        or configured; a later one that cannot is tried again, calls meanwhile failing at their
        bound with the reason."""
        quick_ends = 0
        while True:
            started = trio.current_time()
            try:
                await self._keep_one(task_status)
            except FinalizationUnavailable as exc:
                if self.finalizes is None:
                    raise
                self._last_end = f"Gym's finalizer could not be started again: {exc}"
            task_status = trio.TASK_STATUS_IGNORED
            lived = trio.current_time() - started
            quick_ends = quick_ends + 1 if lived < MAX_RESTART_BACKOFF_S else 1
            pause = min(RESTART_BACKOFF_S * quick_ends, MAX_RESTART_BACKOFF_S)
            log_event(
                "finalizer_restarting", level=logging.WARNING, why=self._last_end, after_s=pause
            )
            await trio.sleep(pause)

    async def _keep_one(self, task_status: trio.TaskStatus[None]) -> None:
        """One worker from start to end: configured, used until it exits, then stopped.
        Raises :class:`FinalizationUnavailable` if it cannot be started or configured."""
        self.starts += 1
        try:
            process = await self.start_worker()
        except OSError as exc:
            raise FinalizationUnavailable(f"cannot start Gym's finalizer: {exc}") from exc
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
                    self._use(worker)
                    task_status.started()
                    await worker.gone.wait()
                    self._use(None)
                nursery.cancel_scope.cancel()
        finally:
            if self._worker is worker:
                self._use(None)
            worker.end(self._death(worker, "was stopped"))
            self._last_end = worker.ended or self._last_end
            with trio.CancelScope(shield=True):
                await self._stop(process)
        if refused is not None:
            raise refused

    async def _watch(self, worker: _Worker) -> None:
        """Read the worker's answers and its standard error until it exits; then, once the
        last of its output is in (within a second), end it: its calls in flight fail."""
        process = worker.process
        async with trio.open_nursery() as pipes:
            pipes.start_soon(worker.read_answers)
            if process.stderr is not None:
                pipes.start_soon(worker.stderr.pump, "stderr", process.stderr)
            status = await process.wait()
            pipes.cancel_scope.deadline = trio.current_time() + 1.0
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
            log_event("finalizer_ready", finalizes=self.finalizes, start=self.starts)
            return
        raise FinalizationUnavailable(
            f"Gym's finalizer was not ready within {self.start_timeout_s:g} s"
        )

    def _use(self, worker: _Worker | None) -> None:
        self._worker = worker
        self._worker_changed.set()
        self._worker_changed = trio.Event()

    async def _stop(self, process: WorkerProcess) -> None:
        """Close its standard input (it exits at end-of-file), then kill it after the grace."""
        if process.stdin is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await process.stdin.aclose()
        with trio.move_on_after(STOP_GRACE_S):
            await process.wait()
            return
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()

    async def _call(self, op: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """A call to the worker running now (waiting for one being started), within
        ``call_timeout_s``; a worker that does not answer in time is killed (and so started
        again). Raises :class:`FinalizeFailed` saying why."""
        worker: _Worker | None = None
        with trio.move_on_after(self.call_timeout_s):
            while self._worker is None or self._worker.ended is not None:
                await self._worker_changed.wait()
            worker = self._worker
            return await worker.call(op, fields)
        if worker is None:
            raise FinalizeFailed(
                f"no Gym finalizer was running within {self.call_timeout_s:g} s "
                f"(NMP_GYM_FINALIZE_TIMEOUT_S); the last one: {self._last_end}"
            )
        worker.end(
            f"Gym's finalizer did not answer within {self.call_timeout_s:g} s "
            "(NMP_GYM_FINALIZE_TIMEOUT_S); it was stopped, and is started again"
        )
        with contextlib.suppress(ProcessLookupError):
            worker.process.kill()
        raise FinalizeFailed(worker.ended or "")

    async def prepare(self, row: Mapping[str, Any]) -> None:
        """Clear the old captures of the row's capture key, before its ``/run``."""
        await self._call("prepare", {"row": row})

    async def finish(
        self, row: Mapping[str, Any], record: Mapping[str, Any], latency_ms: float | None
    ) -> Finished:
        """The record as Gym's collection finishes it (and what to retire once delivered)."""
        answer = await self._call(
            "finish", {"row": row, "record": record, "latency_ms": latency_ms}
        )
        finished = answer.get("record")
        if not isinstance(finished, dict):
            raise FinalizeFailed(f"Gym's finalizer answered no record: {str(answer)[:200]}")
        return Finished(finished, Retirement.from_answer(answer.get("retire")))

    async def retire(self, retirement: Retirement) -> None:
        """Let Gym drop the token snapshot of a record that has been delivered."""
        await self._call("retire", {"retire": attrs.asdict(retirement)})
