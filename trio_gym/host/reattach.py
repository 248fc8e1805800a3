"""Batches a caller may come back to: ``POST /rollouts/run`` with ``Idempotency-Key: <key>``.

A keyed batch runs in the host's own nursery, not its caller's connection, and writes its answer
(status, heartbeats, then the document or the rows) into an :class:`AnswerLog`. Every caller
that POSTs the same key and the same request — the body, its ``Accept`` and HTTP version —
*attaches*: it is sent the log from its start, and then what is added, until the end. Another
request under a key in use is refused (422 ``idempotency_key_reused``, naming the key).

While no caller is attached, the batch runs on for ``reattach_grace_s``; then it is cancelled
as an unkeyed batch is at its caller's disconnect; ``DELETE`` under the key cancels it now. A
finished answer is kept for ``answer_retention_s`` and within ``answer_retention_bytes`` of
finished answers (the oldest go first; one finished less than the grace ago, or still being
sent, stays whatever its size: its caller may be coming back), so a caller whose answer was cut
gets it whole; a key whose answer is no longer kept is refused (410 ``answer_expired``) for as
long as the host remembers it, never run again.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Final

import attrs
import trio

from trio_gym.changes import Changes
from trio_gym.errors import ErrorCode, WireError
from trio_gym.http import ChunkedBody, ConnectionLost, HttpConnection, send_body
from trio_gym.http.h11_build import h11
from trio_gym.logs import log_event
from trio_gym.protocol.rollouts import IDEMPOTENCY_KEY_HEADER

MAX_KEY_LENGTH: Final = 255
REMEMBERED_KEYS: Final = 4096
"""Keys whose answers were dropped, remembered to refuse them (older ones are forgotten)."""


def idempotency_key(head: h11.Request) -> str | None:
    """The request's key, ``None`` without one; ``invalid_request`` for a malformed one."""
    values = [value for name, value in head.headers if name == IDEMPOTENCY_KEY_HEADER.encode()]
    if not values:
        return None
    if len(values) > 1:
        raise WireError(
            ErrorCode.INVALID_REQUEST, f"{IDEMPOTENCY_KEY_HEADER} is given {len(values)} times"
        )
    key = values[0].decode("ascii", "replace")
    if not 1 <= len(key) <= MAX_KEY_LENGTH or not key.isprintable() or " " in key:
        raise WireError(
            ErrorCode.INVALID_REQUEST,
            f"{IDEMPOTENCY_KEY_HEADER} must be 1 to {MAX_KEY_LENGTH} visible ASCII characters "
            "without spaces (a UUID is one)",
        )
    return key


@attrs.define(eq=False)
class AnswerLog:
    """One keyed batch's answer as written so far; readers wake as it grows."""

    status: int = 0
    content_type: str = ""
    chunked: bool = True
    pieces: list[bytes] = attrs.field(factory=list)
    size: int = 0
    started: bool = False
    ended: bool = False
    broken: bool = False
    """It stopped before its end (no caller came back, or the host stopped): a caller's
    connection is then cut, never ended as if whole."""
    changes: Changes = attrs.field(factory=Changes)

    def start(self, status: int, content_type: str, *, chunked: bool) -> None:
        self.status, self.content_type, self.chunked, self.started = (
            status, content_type, chunked, True
        )  # fmt: skip
        self.changes.note()

    def add(self, data: bytes, *, last: bool = False) -> None:
        if data:
            self.pieces.append(data)
            self.size += len(data)
        self.ended = last
        self.changes.note()

    def breaks(self) -> None:
        self.broken = True
        self.changes.note()


class LogBody:
    """A chunked answer's body written into an :class:`AnswerLog` (what a batch writes to a
    caller's :class:`~trio_gym.http.ChunkedBody` otherwise); it never blocks."""

    def __init__(self, log: AnswerLog) -> None:
        self.log = log

    async def send(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.log.add(data)

    def send_nowait(self, data: bytes) -> bool:
        self.log.add(data)
        return True

    async def finish(self, last: bytes = b"") -> None:
        await trio.lowlevel.checkpoint()
        self.log.add(last, last=True)


@attrs.define(eq=False)
class KeyedBatch:
    key: str
    digest: str
    log: AnswerLog = attrs.field(factory=AnswerLog)
    callers: int = 0
    finished_at: float | None = None
    refusal: WireError | None = None
    """Refused before its answer began (not kept: the same key may run once that passes)."""
    caller_changes: Changes = attrs.field(factory=Changes)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    """Around its run: a caller's ``DELETE`` cancels it."""


Runs = Callable[[KeyedBatch], Awaitable[None]]


class KeyedBatches:
    """The keyed batches of one host: running, finished and kept, and forgotten."""

    def __init__(self, *, grace_s: float, retention_s: float, retention_bytes: int) -> None:
        self.grace_s, self.retention_s, self.retention_bytes = grace_s, retention_s, retention_bytes
        self._batches: dict[str, KeyedBatch] = {}
        self._finished: collections.OrderedDict[str, KeyedBatch] = collections.OrderedDict()
        """Oldest first: in the order they finished."""
        self._finished_bytes = 0
        self._expired: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Key -> why its answer is not kept."""
        self._nursery: trio.Nursery | None = None
        self.reattached_total = 0

    @property
    def running(self) -> bool:
        return self._nursery is not None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the keyed batches (a task of the host's background nursery); they end with it."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def find(self, key: str, digest: str) -> KeyedBatch | None:
        """The batch already known under ``key`` for this request; refuses another request
        under it, and a key whose answer is no longer kept."""
        self._forget_old()
        batch = self._batches.get(key)
        if batch is None:
            if key in self._expired:
                raise WireError(
                    ErrorCode.ANSWER_EXPIRED,
                    f"{IDEMPOTENCY_KEY_HEADER} {key!r}: {self._expired[key]}; its batch ran "
                    "here and is not run again under this key",
                )
            return None
        if batch.digest != digest:
            raise WireError(
                ErrorCode.IDEMPOTENCY_KEY_REUSED,
                f"{IDEMPOTENCY_KEY_HEADER} {key!r} belongs to another request (another body, "
                "Accept or HTTP version); send a new key with each request",
            )
        return batch

    def start(self, key: str, digest: str, run: Runs) -> KeyedBatch:
        """Register ``key`` and run its batch (``run`` writes into its log) in the host's
        nursery."""
        assert self._nursery is not None
        batch = self._batches[key] = KeyedBatch(key, digest)
        self._nursery.start_soon(self._run, batch, run)
        return batch

    def cancel(self, key: str) -> bool:
        """Cancel the running batch under ``key`` now; whether there was one. A key that runs
        nothing here is remembered as given up, so a POST under it still on its way (held in a
        proxy) is refused instead of run."""
        batch = self._batches.get(key)
        if batch is None:
            if key not in self._expired:
                self._expire(key, "its caller gave it up (DELETE) before it arrived")
            return False
        if batch.log.ended:
            return False
        log_event("keyed_batch_cancelled", key=key)
        batch.scope.cancel()
        return True

    async def _run(self, batch: KeyedBatch, run: Runs) -> None:
        try:
            with batch.scope:
                await run(batch)
        except WireError as refusal:  # before its answer began: not kept, the key is free
            self._refused(batch, refusal)
            return
        except Exception:  # the boundary handle_connection is for an unkeyed batch
            log_event("keyed_batch_failed", level=logging.ERROR, key=batch.key, exc_info=True)
            if not batch.log.started:
                internal = "the host failed unexpectedly; its log has the details"
                self._refused(batch, WireError(ErrorCode.INTERNAL, internal))
                return
        finally:
            if not batch.log.ended and batch.refusal is None:  # cut off (abandoned, stopping)
                batch.log.breaks()
                del self._batches[batch.key]
                why = "cancelled by its caller" if batch.scope.cancel_called else "stopped"
                self._expire(batch.key, f"its batch was {why} before its answer ended")
        if batch.log.ended:
            batch.finished_at = trio.current_time()
            self._finished[batch.key] = batch
            self._finished_bytes += batch.log.size
            self._forget_old()

    def _refused(self, batch: KeyedBatch, refusal: WireError) -> None:
        batch.refusal = refusal
        del self._batches[batch.key]
        batch.log.breaks()

    async def until_abandoned(self, batch: KeyedBatch) -> None:
        """Return once no caller has been attached for ``grace_s``: the batch's watcher."""
        while True:
            while batch.callers:
                await batch.caller_changes.wait()
            with trio.move_on_after(self.grace_s):
                await batch.caller_changes.wait()
                continue
            if not batch.callers:
                log_event("keyed_batch_abandoned", key=batch.key, grace_s=self.grace_s)
                raise ConnectionLost(
                    f"no caller came back for {IDEMPOTENCY_KEY_HEADER} {batch.key!r} within "
                    f"{self.grace_s:g} s (reattach_grace_s)"
                )

    async def attach(self, batch: KeyedBatch, conn: HttpConnection, *, again: bool) -> None:
        """Send ``batch``'s answer to ``conn`` from its start, as it grows, until its end."""
        batch.callers += 1
        batch.caller_changes.note()
        if again:
            self.reattached_total += 1
            log_event("keyed_batch_attached", key=batch.key, callers=batch.callers)
        try:
            await self._send(batch, conn)
        finally:
            batch.callers -= 1
            batch.caller_changes.note()
            self._forget_old()

    async def _send(self, batch: KeyedBatch, conn: HttpConnection) -> None:
        log = batch.log
        while not log.started and not log.broken:
            await log.changes.wait()
        if batch.refusal is not None:
            raise batch.refusal
        if not log.started:  # stopped before it answered (a DELETE, the host stopping)
            raise ConnectionLost("the batch stopped before its answer began")
        if not log.chunked:
            while not log.ended:
                await log.changes.wait()
            await send_body(conn, log.status, b"".join(log.pieces), content_type=log.content_type)
            return
        body = await ChunkedBody.start(conn, log.status, content_type=log.content_type)
        sent = 0
        while True:
            while sent < len(log.pieces):
                await body.send(log.pieces[sent])
                sent += 1
            if log.broken:
                raise ConnectionLost("the batch stopped before its answer ended")
            if log.ended:
                await body.finish()
                return
            await log.changes.wait()

    def _forget_old(self) -> None:
        """Drop finished answers past their retention, then the oldest beyond the bytes kept.
        An answer finished less than ``grace_s`` ago stays whatever its size (its caller, cut,
        may be coming back for it), and one a caller is still being sent stays until it is sent:
        the bytes bound is on the answers no caller can still be reading or returning for."""
        now = trio.current_time()
        # Oldest first, so the sweep stops at the first answer too young to go: every later
        # one is younger still (and the bytes kept only fall), which keeps a call's cost to
        # what it drops, not to all that is kept.
        dropped = []
        for batch in self._finished.values():
            age = now - (batch.finished_at or now)
            if age < min(self.grace_s, self.retention_s):
                break
            if age < self.retention_s and self._finished_bytes <= self.retention_bytes:
                break
            if not batch.callers:
                dropped.append(batch)
                self._finished_bytes -= batch.log.size
        for batch in dropped:
            del self._finished[batch.key]
            del self._batches[batch.key]
            self._expire(
                batch.key,
                f"its answer is no longer kept (answers are kept {self.retention_s:g} s, within "
                f"{self.retention_bytes} bytes: answer_retention_s, answer_retention_bytes)",
            )

    def _expire(self, key: str, why: str) -> None:
        self._expired[key] = why
        while len(self._expired) > REMEMBERED_KEYS:
            self._expired.popitem(last=False)


def request_digest(body: bytes, *, rows: bool, http_version: bytes) -> str:
    """What makes two POSTs under one key the same request."""
    hasher = hashlib.sha256(body)
    hasher.update(b"\0rows" if rows else b"\0document")
    hasher.update(b"\0" + http_version)
    return hasher.hexdigest()


@attrs.frozen
class KeyedCaller:
    """Whoever attaches to ``batch``: its answer goes into its log, and it is gone once no
    caller has been attached for the grace (:class:`~trio_gym.host.supervision.Caller`)."""

    batches: KeyedBatches
    batch: KeyedBatch
    http_version: bytes

    async def start(self, status: int, *, content_type: str) -> LogBody:
        await trio.lowlevel.checkpoint()
        self.batch.log.start(status, content_type, chunked=True)
        return LogBody(self.batch.log)

    async def send_whole(self, status: int, body: bytes, *, content_type: str) -> None:
        await trio.lowlevel.checkpoint()
        self.batch.log.start(status, content_type, chunked=False)
        self.batch.log.add(body, last=True)

    async def until_gone(self, body: object, heartbeat: bytes) -> None:
        await self.batches.until_abandoned(self.batch)
