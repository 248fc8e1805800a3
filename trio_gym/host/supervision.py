"""Running a batch's examples under supervision: heartbeat, caller watcher, shutdown, deadline.

The examples run in one nursery beside

- a heartbeat: a chunk every ``heartbeat_interval_s`` (HTTP/1.1 only), so proxies see bytes
  long before the batch ends, and a write to a departed caller fails;
- a caller watcher: a reset means the caller is gone; an end-of-file may be a half-close (the
  caller shut down its writing side and still reads), so it is probed with two heartbeats a
  round trip apart: a peer that is really gone answers the first with a reset and fails the
  second;
- a shutdown watcher: when the host stops, the examples are cancelled and the batch is answered
  ``shutting_down``.

When the caller is gone, the nursery is cancelled and with it every running example; nothing is
left running. The deadline is the batch's own scope (its pausable deadline's, around the
examples, the heartbeat and the watcher), so a batch that outlives it is cancelled and still
answered (``deadline_exceeded``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final, Protocol

import attrs
import trio

from trio_gym.errors import ErrorCode, WireError, leaves
from trio_gym.http import ChunkedBody, ConnectionLost, HttpConnection, send_body

from .batch_state import Batch
from .pacer import Pacer
from .state import Services
from .stats import HostStats

# The caller watcher starts this long into a batch (and its running line is logged then): most
# short batches are over by then, and spawning, parking and cancelling a task for each was a
# tenth of their cost. A caller who leaves sooner is noticed this late at most.
WATCH_AFTER_S: Final = 0.005


class Body(Protocol):
    """Where a chunked answer's pieces go: a caller's connection, or a keyed batch's log."""

    async def send(self, data: bytes) -> None: ...
    def send_nowait(self, data: bytes) -> bool: ...
    async def finish(self, last: bytes = b"") -> None: ...


class Caller(Protocol):
    """Who a batch answers: one connection (:class:`ConnectionCaller`), or whoever attaches to
    a keyed batch (:mod:`.reattach`)."""

    @property
    def http_version(self) -> bytes: ...
    async def start(self, status: int, *, content_type: str, heartbeat: bytes) -> Body:
        """Begin a chunked answer; ``heartbeat`` is what a watcher may write into it to learn
        whether a caller is still there."""
        ...

    async def send_whole(self, status: int, body: bytes, *, content_type: str) -> None: ...
    async def until_gone(self, body: Body | None, heartbeat: bytes) -> None:
        """Raise :class:`ConnectionLost` once the caller is known to be gone; return when
        nothing more can be learned by watching."""
        ...


@attrs.frozen
class ConnectionCaller:
    """The caller at the other end of ``conn``: a batch without a key ends with it."""

    conn: HttpConnection

    @property
    def http_version(self) -> bytes:
        return self.conn.their_http_version or b""

    async def start(self, status: int, *, content_type: str, heartbeat: bytes) -> Body:
        return await ChunkedBody.start(self.conn, status, content_type=content_type)

    async def send_whole(self, status: int, body: bytes, *, content_type: str) -> None:
        await send_body(self.conn, status, body, content_type=content_type)

    async def until_gone(self, body: Body | None, heartbeat: bytes) -> None:
        await self.conn.watch_peer(None if body is None else partial(body.send, heartbeat))


async def supervise(
    services: Services,
    caller: Caller,
    body: Body | None,
    batch: Batch,
    *,
    heartbeat: bytes,
    deadline_s: float,
    work: Callable[[], Awaitable[None]],
) -> WireError | None:
    """Run ``work`` (the batch's examples) beside the heartbeat and the watchers.

    ``body`` is the started chunked answer (``None`` for HTTP/1.0: no heartbeat, no probes).
    Returns ``None`` when ``work`` finished, or the ``deadline_exceeded`` / ``shutting_down``
    error that stopped it. Raises :class:`ConnectionLost` if the caller left, after every
    example was cancelled.
    """
    caller_lost: ConnectionLost | None = None
    beat: _Heartbeat | None = None
    completed = False
    try:
        # The batch's own scope (its pausable deadline's) holds the examples, the heartbeat and
        # the watcher: its deadline, the host's shutdown and a departed caller each cancel
        # everything in it. How it ended is told apart below.
        with batch.deadline.scope as batch_scope:
            batch_scope.deadline = trio.current_time() + deadline_s
            async with trio.open_nursery() as nursery:
                pacer = services.pacer
                if not pacer.running:
                    # A host driven without serve (embedded, or a test): the batch owns a pacer
                    # of its own, so heartbeats and the watcher's start take one road either way.
                    pacer = Pacer()
                    await nursery.start(pacer.run)
                lasting = partial(_batch_lasts, nursery, batch, caller, body, heartbeat)
                timers = [pacer.call_after(WATCH_AFTER_S, lasting)]
                if body is not None:
                    interval_s = services.config.heartbeat_interval_s
                    due = trio.current_time() + interval_s
                    beat = _Heartbeat(body, heartbeat, batch_scope, services.stats, interval_s, due)
                    timers.append(pacer.start_every(interval_s, beat))
                services.lifecycle.cancel_on_shutdown(batch_scope)
                try:
                    await work()
                    completed = True
                finally:
                    services.lifecycle.forget_on_shutdown(batch_scope)
                    for timer in timers:
                        timer.stop()
                batch_scope.cancel()  # the watcher, and the batch's own pacer if it has one
    except* ConnectionLost as group:
        caller_lost = leaves(group)[0]
    if caller_lost is None and beat is not None:
        caller_lost = beat.lost
    if caller_lost is not None:
        raise caller_lost
    if completed:
        return None
    if services.lifecycle.shutdown_requested.is_set():
        return WireError(
            ErrorCode.SHUTTING_DOWN,
            "the host is shutting down; every unfinished example of this batch was cancelled",
        )
    return WireError(
        ErrorCode.DEADLINE_EXCEEDED,
        f"the batch of {batch.size} examples outlived its deadline of {deadline_s:g} s and "
        "its unfinished examples were cancelled; send fewer or shorter examples per request, "
        "or a larger deadline_s (capped by NMP_ROLLOUT_DEADLINE_S)",
    )


def _batch_lasts(
    nursery: trio.Nursery,
    batch: Batch,
    caller: Caller,
    body: Body | None,
    heartbeat: bytes,
) -> None:
    """The batch outlived ``WATCH_AFTER_S``: watch its caller, say in the log that it runs."""
    nursery.start_soon(caller.until_gone, body, heartbeat)
    batch.log_running()


@attrs.define
class _Heartbeat:
    """A heartbeat the pacer writes without waiting (no task per connection); a caller found
    gone cancels the batch, and :func:`supervise` raises what was found."""

    body: Body
    data: bytes
    batch: trio.CancelScope
    stats: HostStats
    interval_s: float
    due: float
    """When the pacer should call it next: one interval after it started, then after each call."""
    lost: ConnectionLost | None = None

    def __call__(self) -> None:
        now = trio.current_time()
        late, self.due = now - self.due, now + self.interval_s
        try:
            # skipped (False) while another write is under way: not a heartbeat sent
            if self.body.send_nowait(self.data):
                self.stats.count_beat(late)
        except ConnectionLost as exc:
            self.lost = exc
            self.batch.cancel()
