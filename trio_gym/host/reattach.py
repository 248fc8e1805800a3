"""Batches a caller may come back to: ``POST /rollouts/run`` with ``Idempotency-Key: <key>``.

A keyed batch is a batch like any other, owned by the connection that sent it (its handler's
task runs it, :meth:`KeyedBatches.run`); what differs is where it writes its answer — status,
heartbeats, then the document or the rows — into an :class:`AnswerLog`, which that connection
reads beside it. Every caller that POSTs the same key and the same request (the body, its
``Accept`` and HTTP version) *attaches*: it is sent the log from its start, and then what is
added, until the end. Another request under a key in use is refused (422
``idempotency_key_reused``, naming the key as sent).

The connection's socket is closed once its caller has the answer or is gone; its handler holds
the batch on: while no caller is attached, for ``reattach_grace_s``, then the batch is given up
as an unkeyed batch is at its caller's disconnect; a ``DELETE`` under the key gives it up now.
A finished answer is kept for ``answer_retention_s`` and within ``answer_retention_bytes`` of
finished answers (the oldest go first; one finished less than the grace ago, or still being
sent, stays whatever its size: its caller may be coming back), so a caller whose answer was cut
gets it whole. A key that ran here and holds no answer any more is refused (410
``answer_expired``) — :mod:`.keys` remembers it.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final

import attrs
import trio

from trio_gym.changes import Changes
from trio_gym.errors import ErrorCode, WireError, leaves
from trio_gym.http import ChunkedBody, ConnectionLost, HttpConnection, send_body
from trio_gym.logs import log_event

from .batch_state import Batch
from .keys import Gone, KeyMemory, answer_expired

ANSWER_OVERHEAD_BYTES: Final = 1024
"""What a kept answer costs beyond its bytes (its records here), counted against the bytes kept:
a flood of empty answers is bounded too."""


@attrs.define(eq=False)
class AnswerLog:
    """One keyed batch's answer as written so far; readers wake as it grows."""

    status: int = 0
    content_type: str = ""
    heartbeat: bytes | None = None
    """What a caller's watcher may write into the answer to learn whether it is there; ``None``
    for a buffered answer (HTTP/1.0), which nothing may be written into before its end."""
    pieces: list[bytes] = attrs.field(factory=list)
    size: int = 0
    started: bool = False
    ended: bool = False
    broken: bool = False
    """It stopped before its end (no caller came back, or the host stopped): a caller's
    connection is then cut, never ended as if whole."""
    changes: Changes = attrs.field(factory=Changes)

    def start(self, status: int, content_type: str, *, heartbeat: bytes | None) -> None:
        """Begin the answer: chunked, with ``heartbeat``; buffered (HTTP/1.0) with ``None``."""
        self.status, self.content_type, self.heartbeat = status, content_type, heartbeat
        self.started = True
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
    batch: Batch
    """The batch itself: its id, whether it ran, whether its caller gave it up."""
    digest: str
    log: AnswerLog = attrs.field(factory=AnswerLog)
    callers: int = 0
    finished_at: float | None = None
    refusal: WireError | None = None
    """Why it was refused before its answer began, for the callers attached by then."""
    caller_changes: Changes = attrs.field(factory=Changes)

    @property
    def gone(self) -> Gone:
        """Why its key runs nothing any more, once it stopped before its answer ended."""
        return Gone.GIVEN_UP if self.batch.given_up else Gone.STOPPED

    @property
    def kept_bytes(self) -> int:
        """What keeping its finished answer costs, counted against the bytes kept."""
        return self.log.size + ANSWER_OVERHEAD_BYTES


Runs = Callable[["KeyedCaller"], Awaitable[None]]


class KeyedBatches:
    """The keyed batches of one host: running, finished and kept; and the keys that hold
    nothing any more (:class:`~trio_gym.host.keys.KeyMemory`)."""

    def __init__(self, *, grace_s: float, retention_s: float, retention_bytes: int) -> None:
        self.grace_s, self.retention_s, self.retention_bytes = grace_s, retention_s, retention_bytes
        self._batches: dict[str, KeyedBatch] = {}
        self._finished: collections.OrderedDict[str, KeyedBatch] = collections.OrderedDict()
        """Oldest first: in the order they finished."""
        self._finished_bytes = 0
        self.memory = KeyMemory(lifetime_s=retention_s)
        self.reattached_total = 0

    def find(self, key: str, digest: str) -> KeyedBatch | None:
        """The batch already known under ``key`` for this request; refuses another request
        under it, and a key that holds no answer any more."""
        self._forget_old()
        batch = self._batches.get(key)
        if batch is None:
            gone = self.memory.why(key, trio.current_time())
            if gone is not None:
                raise self._expired(key, gone)
            return None
        if batch.digest != digest:
            raise WireError(
                ErrorCode.IDEMPOTENCY_KEY_REUSED,
                f"Idempotency-Key: {key} belongs to another request (another body, "
                "Accept or HTTP version); send a new key with each request",
            )
        return batch

    def _expired(self, key: str, gone: Gone) -> WireError:
        """The ``410`` for a key that holds no answer here, saying why."""
        why = str(gone.value)
        if gone is Gone.EXPIRED:
            why += (
                f" (answers are kept {self.retention_s:g} s, within {self.retention_bytes} "
                "bytes: answer_retention_s, answer_retention_bytes)"
            )
        return answer_expired(key, why)

    def _unanswered(self, batch: KeyedBatch) -> WireError:
        """What a caller of a batch that stopped before its answer began is told."""
        if batch.refusal is not None:
            return batch.refusal
        return self._expired(batch.key, batch.gone)

    async def run(
        self, key: str, batch: Batch, digest: str, conn: HttpConnection, run: Runs
    ) -> None:
        """Register ``batch`` under ``key`` and run it in this task — the task of ``conn``'s
        handler, which owns it — while ``conn`` is sent its answer beside it. ``conn`` is closed
        once its caller has the answer or is gone; the batch runs on here while a caller may
        come back for it. Raises, for this handler to answer, why a batch stopped before its
        answer began (its refusal: its key is free again unless it ran or was given up); a bug,
        once the first caller has all the log holds."""
        keyed = self._batches[key] = KeyedBatch(key, batch, digest)
        caller = KeyedCaller(self, keyed, conn.their_http_version or b"")
        bug: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._first_caller, keyed, conn)
            try:
                await self._run(keyed, caller, run)
            except Exception as exc:  # not yet: the first caller still gets what the log has
                bug = exc
                if not keyed.log.started:  # what its other callers hear, as the first will
                    internal = "the host failed unexpectedly; its log has the details"
                    keyed.refusal = WireError(ErrorCode.INTERNAL, internal)
        if bug is not None:
            raise bug
        if not keyed.log.started:
            raise self._unanswered(keyed)

    async def _first_caller(self, batch: KeyedBatch, conn: HttpConnection) -> None:
        try:
            await self._attach(batch, conn)
        except WireError:
            return  # nothing said here yet: the handler answers once the run is over
        except ConnectionLost as exc:
            self._caller_left(batch, exc)
        await conn.close()  # its part is over; the batch runs on in this task

    async def _run(self, batch: KeyedBatch, caller: KeyedCaller, run: Runs) -> None:
        try:
            await run(caller)
        except WireError as refusal:  # refused before its answer began
            batch.refusal = refusal
        finally:
            self._ended(batch)

    def _ended(self, batch: KeyedBatch) -> None:
        """File a batch that ended, however it did: its answer kept when whole and it ran;
        otherwise its readers cut and its key remembered, unless nothing ran under it."""
        ran = batch.batch.ran or batch.batch.given_up  # a DELETE answered is a promise too
        if batch.log.ended and ran:
            batch.finished_at = trio.current_time()
            self._finished[batch.key] = batch
            self._finished_bytes += batch.kept_bytes
            self._forget_old()
            return
        if not batch.log.ended:  # refused, or cut (abandoned, given up, stopped, a bug)
            batch.log.breaks()
        del self._batches[batch.key]
        if ran:
            self.memory.ran.add(batch.key, batch.gone)

    def cancel(self, key: str) -> bool:
        """Give up the batch running under ``key`` now; whether there was one. A key that holds
        nothing here yet is remembered as given up, so a POST under it still on its way (held in
        a proxy) is refused instead of run; ``host_busy`` when that cannot be promised."""
        batch = self._batches.get(key)
        if batch is None:
            now = trio.current_time()
            if self.memory.why(key, now) is None:
                self.memory.given_up.add(key, now)
            return False
        if batch.log.ended:
            return False
        batch.batch.given_up = True
        batch.caller_changes.note()
        return True

    async def until_abandoned(self, batch: KeyedBatch) -> None:
        """Raise :class:`ConnectionLost` once the batch's caller gave it up, or no caller has
        been attached for ``grace_s``: the batch's watcher."""
        while True:
            while batch.callers and not batch.batch.given_up:
                await batch.caller_changes.wait()
            if batch.batch.given_up:
                raise ConnectionLost("its caller gave it up (DELETE under its key)")
            with trio.move_on_after(self.grace_s):
                await batch.caller_changes.wait()
                continue
            raise ConnectionLost(
                f"no caller came back for it within {self.grace_s:g} s (reattach_grace_s)"
            )

    async def attach(self, batch: KeyedBatch, conn: HttpConnection) -> None:
        """Send ``batch``'s answer to ``conn``, a caller come back for it, from its start, as it
        grows, until its end."""
        self.reattached_total += 1
        log_event("keyed_batch_attached", batch=batch.batch.id, key=batch.key)
        try:
            await self._attach(batch, conn)
        except ConnectionLost as exc:
            self._caller_left(batch, exc)

    def _caller_left(self, batch: KeyedBatch, lost: Exception) -> None:
        if not batch.log.broken:  # else its own end line says why its callers were cut
            log_event("keyed_caller_left", batch=batch.batch.id, key=batch.key, why=str(lost))

    async def _attach(self, batch: KeyedBatch, conn: HttpConnection) -> None:
        batch.callers += 1
        batch.caller_changes.note()
        try:
            await self._send(batch, conn)
        finally:
            batch.callers -= 1
            batch.caller_changes.note()
            self._forget_old()

    async def _send(self, batch: KeyedBatch, conn: HttpConnection) -> None:
        """Every caller is watched as an unkeyed batch's caller is: one that hangs up is
        detached at once (the grace starts), not at the next heartbeat's failed write. Until
        the answer begins (to its end, over HTTP/1.0) only a reset can be learned."""
        log = batch.log
        await _watched(conn, None, partial(_until_begun, log))
        if not log.started:  # refused, given up or stopped before its answer began
            raise self._unanswered(batch)
        body, probe = None, None
        if log.heartbeat is not None:
            body = await ChunkedBody.start(conn, log.status, content_type=log.content_type)
            probe = partial(body.send, log.heartbeat)
        await _watched(conn, probe, partial(_copy_until_ended, log, body))
        # The end goes out once the watcher is gone: no probe can follow it.
        if body is None:
            await send_body(conn, log.status, b"".join(log.pieces), content_type=log.content_type)
        else:
            await body.finish()

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
                self._finished_bytes -= batch.kept_bytes
        for batch in dropped:
            del self._finished[batch.key]
            del self._batches[batch.key]
            self.memory.ran.add(batch.key, Gone.EXPIRED)


async def _watched(
    conn: HttpConnection,
    probe: Callable[[], Awaitable[None]] | None,
    work: Callable[[], Awaitable[None]],
) -> None:
    """``work`` beside a watcher of ``conn`` (:meth:`~trio_gym.http.HttpConnection.watch_peer`
    with ``probe``); raises :class:`ConnectionLost` if either finds the caller gone."""
    lost: ConnectionLost | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.watch_peer, probe)
            await work()
            nursery.cancel_scope.cancel()
    except* ConnectionLost as group:
        lost = leaves(group)[0]
    if lost is not None:
        raise lost


async def _until_begun(log: AnswerLog) -> None:
    while not log.started and not log.broken:
        await log.changes.wait()


async def _copy_until_ended(log: AnswerLog, body: ChunkedBody | None) -> None:
    """Send ``log``'s pieces into ``body`` from its start as it grows (a buffered answer's
    wait whole), until it has ended; raises :class:`ConnectionLost` where it broke off."""
    sent = 0
    while True:
        while body is not None and sent < len(log.pieces):
            await body.send(log.pieces[sent])
            sent += 1
        if log.broken:
            raise ConnectionLost("the batch stopped before its answer ended")
        if log.ended:
            return
        await log.changes.wait()


def request_digest(body: bytes, *, rows: bool, http_version: bytes) -> str:
    """What makes two POSTs under one key the same request."""
    hasher = hashlib.sha256(body)
    hasher.update(b"\0rows" if rows else b"\0document")
    hasher.update(b"\0" + http_version)
    return hasher.hexdigest()


@attrs.frozen
class KeyedCaller:
    """Whoever attaches to ``batch``: its answer goes into its log, and it is gone once its
    caller gave it up or no caller has been attached for the grace
    (:class:`~trio_gym.host.supervision.Caller`)."""

    batches: KeyedBatches
    batch: KeyedBatch
    http_version: bytes

    async def start(self, status: int, *, content_type: str, heartbeat: bytes) -> LogBody:
        await trio.lowlevel.checkpoint()
        self.batch.log.start(status, content_type, heartbeat=heartbeat)
        return LogBody(self.batch.log)

    async def send_whole(self, status: int, body: bytes, *, content_type: str) -> None:
        await trio.lowlevel.checkpoint()
        self.batch.log.start(status, content_type, heartbeat=None)
        self.batch.log.add(body, last=True)

    async def until_gone(self, body: object, heartbeat: bytes) -> None:
        await self.batches.until_abandoned(self.batch)
