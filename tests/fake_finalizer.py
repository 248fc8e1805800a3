"""A stand-in for Gym's finalizer worker (``trio_gym/runners/finalize_worker.py``), over memory
streams, so the finalizer's bounds, restarts and refusals run on a virtual clock.

Each started worker is a task of the test's nursery that reads JSON-line requests and answers
them as its ``behaviour`` says: by default ``configure`` says what it finalizes, ``prepare``
answers at once, ``finish`` marks the record (``"finished_by": <worker number>``) and offers its
snapshot to retire (rollout ``<task>-<rollout>``, snapshot ``s<worker>``), ``retire`` answers. A
behaviour returns an answer's fields, ``None`` for no answer at all (a worker that hangs), or
raises :class:`Die` to exit with a status (after printing its last words on standard error).
With ``serial``, requests are answered one at a time, in order, as the real worker answers them;
otherwise each at once. Its standard input is one of trio's memory pipes — with ``full_pipe`` a
lockstep one, so every write waits for the worker to read it and can stop half-way — read only
while ``reading`` is set.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing

Behaviour = Callable[[int, dict[str, Any]], Awaitable[dict[str, Any] | None]]


class Die(Exception):
    def __init__(self, status: int, last_words: str = "") -> None:
        super().__init__(status)
        self.status = status
        self.last_words = last_words


async def default_behaviour(worker: int, request: dict[str, Any]) -> dict[str, Any] | None:
    op = request["op"]
    if op == "configure":
        return {"ok": True, "finalizes": ["model_call_capture"]}
    if op == "finish":
        record = {**request["record"], "finished_by": worker}
        rollout = f"{record.get('_ng_task_index')}-{record.get('_ng_rollout_index')}"
        retire = {"rollout_id": rollout, "snapshot_id": f"s{worker}", "version": 1}
        return {"ok": True, "record": record, "retire": retire}
    return {"ok": True}


class FakeWorkerProcess:
    """One started worker: the streams the finalizer speaks over, and its end."""

    def __init__(
        self, number: int, noted: Callable[[], None], *, serial: bool, full_pipe: bool
    ) -> None:
        self.number = number
        self._noted = noted
        self._serial = serial
        self.reading = trio.Event()
        self.reading.set()
        self.stdin, self._requests = (
            trio.testing.lockstep_stream_one_way_pair()
            if full_pipe
            else trio.testing.memory_stream_one_way_pair()
        )
        self._answers, self.stdout = trio.testing.memory_stream_one_way_pair()
        self._errors, self.stderr = trio.testing.memory_stream_one_way_pair()
        self.returncode: int | None = None
        self.stdin_closed = False
        self._answering = trio.Lock()
        self.requests: list[dict[str, Any]] = []
        self._exited = trio.Event()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    stubborn = False
    """A process in an uninterruptible wait: it heeds neither end-of-file nor SIGKILL."""

    def kill(self) -> None:
        if not self.stubborn:
            self._exit(-9)

    def _exit(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            self._answers.close()
            self._errors.close()
            self._requests.close()  # as a dead process's pipe: the next write fails
            self._exited.set()

    async def serve(self, behaviour: Behaviour) -> None:
        """Answer requests until standard input ends (then exit 0) or the behaviour dies."""
        buffer = b""
        async with trio.open_nursery() as answering:
            while self.returncode is None:
                await self.reading.wait()
                try:
                    data = await self._requests.receive_some(65536)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    data = b""
                if not data:
                    self.stdin_closed = True
                    if self.stubborn:
                        await trio.sleep_forever()
                    self._exit(0)
                    break
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    request = json.loads(line)  # a line cut short fails the test here
                    self.requests.append(request)
                    self._noted()
                    if self._serial:
                        await self._answer(behaviour, request)
                    else:
                        answering.start_soon(self._answer, behaviour, request)
            answering.cancel_scope.cancel()

    async def say(self, line: bytes) -> None:
        """Write ``line`` on the answers channel, as a worker's stray print would."""
        async with self._answering:
            await self._answers.send_all(line)

    async def _answer(self, behaviour: Behaviour, request: dict[str, Any]) -> None:
        try:
            answer = await behaviour(self.number, request)
        except Die as death:
            if death.last_words:
                await self._errors.send_all(death.last_words.encode() + b"\n")
            self._exit(death.status)
            return
        if answer is None or self.returncode is not None:
            return
        line = json.dumps({"id": request["id"], **answer}).encode() + b"\n"
        async with self._answering:  # one answer written at a time, as from one process
            with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
                await self._answers.send_all(line)


class FakeWorkers:
    """Starts fake workers in ``nursery``, each answering as ``behaviour`` says."""

    def __init__(
        self,
        nursery: trio.Nursery,
        behaviour: Behaviour = default_behaviour,
        *,
        serial: bool = False,
        full_pipe: bool = False,
    ) -> None:
        self.nursery = nursery
        self.behaviour = behaviour
        self.serial = serial
        self.full_pipe = full_pipe
        self.started: list[FakeWorkerProcess] = []
        self.refuse_start: OSError | None = None
        self._changed = trio.Event()

    def requests(self, op: str) -> list[dict[str, Any]]:
        """Every request of ``op`` the workers were sent, in order."""
        return [r for worker in self.started for r in worker.requests if r["op"] == op]

    def retired(self) -> list[str]:
        """The rollouts whose snapshots the workers were asked to retire, in order."""
        return [s["rollout_id"] for r in self.requests("retire") for s in r["retire"]]

    async def wait_for(self, op: str, count: int) -> None:
        """Until the workers have been sent ``count`` requests of ``op``."""
        while len(self.requests(op)) < count:
            await self._changed.wait()

    async def wait_until_retired(self, count: int) -> None:
        while len(self.retired()) < count:
            await self._changed.wait()

    def _note(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def start(self) -> FakeWorkerProcess:
        await trio.lowlevel.checkpoint()
        if self.refuse_start is not None:
            raise self.refuse_start
        worker = FakeWorkerProcess(
            len(self.started) + 1, self._note, serial=self.serial, full_pipe=self.full_pipe
        )
        self.started.append(worker)
        self.nursery.start_soon(worker.serve, self.behaviour)
        return worker
