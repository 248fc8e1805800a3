"""One h11 connection over one :class:`~trio_gym.http.transport.Transport`: serialised,
bounded writes and size-limited reads.

This is the only place h11 meets bytes. It knows nothing of routes or documents; both the host
and the trainer client drive their exchanges through it.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Final, overload

import attrs
import trio

from trio_gym.http.h11_build import h11
from trio_gym.http.limits import HttpLimits
from trio_gym.http.transport import ConnectionLost, Transport

Role = type[h11.CLIENT] | type[h11.SERVER]

# States in which the peer's next bytes belong to a message head.
_HEAD_STATES: Final = (h11.IDLE, h11.SEND_RESPONSE)
# Enough of a request's first bytes to hold any method name and the space after it.
_METHOD_BYTES: Final = 16
# Two probe writes tell a half-closed peer from a departed one (see probe_delay_s): this far
# apart at most, and when the kernel does not say what the round trip is. For a round trip
# longer than that the next heartbeat write notices instead, within one more interval.
PROBE_DELAY_S: Final = 0.2


@attrs.define
class Traffic:
    """Bytes read and written by the connections that share it (a host's callers)."""

    read: int = 0
    written: int = 0


class HttpConnection:
    """An HTTP/1.x exchange over ``transport``, as ``role`` (``h11.CLIENT`` or ``h11.SERVER``).

    Writes go through :meth:`send` (or :meth:`send_nowait`), reads through :meth:`next_event`.
    One task may read while another writes; concurrent writers are serialised. A client may
    send its request as ``request_version=b"1.0"``.
    """

    def __init__(
        self,
        transport: Transport,
        role: Role,
        limits: HttpLimits,
        *,
        request_version: bytes = b"1.1",
        traffic: Traffic | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.limits = limits
        self._on_close = on_close
        self._traffic = traffic
        self._request_version = request_version
        self._transport = transport
        self._h11 = h11.Connection(role, max_incomplete_event_size=limits.max_head_bytes)
        self._send_lock = trio.StrictFIFOLock()
        self._head_bytes = 0
        self._lost = False
        self._closed = False
        self._owed = b""
        """Bytes h11 considers sent that the transport has not taken yet (see send_nowait)."""
        self._owed_since = math.inf
        self.eof_received = False
        """True once the peer shut down its sending side (a half-close or a full close)."""
        self.request_method: bytes | None = None
        """The request's method, once h11 has parsed its head."""
        self._first_bytes = b""
        """The start of what the peer sent: a request h11 refused still named its method."""

    @property
    def answering_head(self) -> bool:
        """Whether the answer is to a ``HEAD`` request — parsed, or refused but named so in its
        request line (RFC 9110 §9.3.2: a response to HEAD never carries a body)."""
        method = self.request_method or self._first_bytes.partition(b" ")[0]
        return method == b"HEAD"

    @property
    def their_http_version(self) -> bytes | None:
        """The peer's HTTP version once its head has arrived, else ``None``."""
        return self._h11.their_http_version

    @property
    def peer_is_done_sending(self) -> bool:
        """True once the peer's whole message (head and body) has been read."""
        return self._h11.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)

    @property
    def peer_waits_for_100_continue(self) -> bool:
        """True if the peer sent ``Expect: 100-continue`` and is holding its body back."""
        return self._h11.they_are_waiting_for_100_continue

    @property
    def can_send_response(self) -> bool:
        """True while a server may still choose a status line (none has been sent)."""
        return self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    def round_trip_s(self) -> float | None:
        """The transport's smoothed round trip to the peer, in seconds, where it knows it."""
        return self._transport.round_trip_s()

    @property
    def lost(self) -> bool:
        """True once a write failed or stalled: the peer can no longer be reached."""
        return self._lost

    async def send(self, *events: h11.Event) -> None:
        """Write ``events`` whole and in order, with no other write between them. A checkpoint.

        Events are written in runs of about ``write_bytes``, each its own write bounded by
        ``send_timeout_s``, so the bound means "the peer took nothing for that long", not "all
        of it within that long". A write that has to wait is shielded from cancellation:
        cancelled half-way, h11 would believe bytes went out that never did (the final document
        after a heartbeat would be refused or corrupt the framing), and a line of a row stream
        would be left half-written. The shield hangs no one: every wait inside it is bounded.

        ``Cancelled`` can only be raised before anything was written. Raises
        :class:`ConnectionLost` if the peer is gone or took nothing for ``send_timeout_s``; the
        connection is then unusable. ``h11.LocalProtocolError`` means the caller broke HTTP: a
        bug, not the peer's doing.
        """
        async with self._send_lock:  # a checkpoint: the lock's acquire is one
            if self._lost:
                raise ConnectionLost("an earlier write to this peer failed")
            pending = bytearray(self._owed)
            self._owed, self._owed_since = b"", math.inf
            for event in events:
                pending += self._bytes_of(event)
                if len(pending) >= self.limits.write_bytes:
                    await self._write(bytes(pending))
                    pending.clear()
            if pending:
                await self._write(bytes(pending))

    def send_nowait(self, *events: h11.Event) -> bool:
        """Write ``events`` now, without waiting, unless another write is under way or what is
        owed from before still finds no room: then return False, having written and changed
        nothing. Not a checkpoint.

        Only for events that leave h11's state as it was (chunks of a body): what the
        transport does not take at once is *owed* and goes out first in the next write of
        either kind. This is how heartbeats are written — one system call each on a socket,
        where :meth:`send` costs a lock and a trip through the scheduler, which ten thousand
        connections beating every second cannot afford. Raises :class:`ConnectionLost` if the
        peer is gone, or has taken none of what is owed for ``send_timeout_s``.
        """
        if self._lost:
            raise ConnectionLost("an earlier write to this peer failed")
        if self._send_lock.locked():
            return False
        if self._owed:
            self._owed = self._owed[self._write_now(self._owed) :]
            if self._owed:
                if trio.current_time() - self._owed_since >= self.limits.send_timeout_s:
                    self._lost = True
                    raise ConnectionLost(
                        f"the peer did not read for {self.limits.send_timeout_s:g} s "
                        "(send_timeout_s)"
                    )
                return False
            self._owed_since = math.inf
        data = b"".join(self._bytes_of(event) for event in events)
        sent = self._write_now(data)
        if sent < len(data):
            self._owed, self._owed_since = data[sent:], trio.current_time()
        return True

    async def _write(self, data: bytes) -> None:
        data = data[self._write_now(data) :]
        transport = self._transport
        if not data and not transport.queued_bytes:
            return
        # Shielded (see send); most writes fit a socket's buffer and never get here. What a
        # stream's transport queued is handed on before returning: no other task may be
        # waiting on the transport to send it.
        with trio.CancelScope(shield=True), trio.move_on_after(self.limits.send_timeout_s) as scope:
            while data or transport.queued_bytes:
                await transport.wait_writable()
                data = data[self._write_now(data) :]
        if scope.cancelled_caught:
            self._lost = True
            raise ConnectionLost(
                f"the peer did not read for {self.limits.send_timeout_s:g} s (send_timeout_s)"
            )

    def _write_now(self, data: bytes) -> int:
        try:
            written = self._transport.write_now(data)
        except ConnectionLost:
            self._lost = True
            raise
        if self._traffic is not None:
            self._traffic.written += written
        return written

    def _bytes_of(self, event: h11.Event) -> bytes:
        data = self._h11.send(event) or b""
        if isinstance(event, h11.Request) and self._request_version == b"1.0":
            # h11 writes only HTTP/1.1 request lines; everything else it writes for a request
            # (Host, Content-Length, Connection: close) is valid HTTP/1.0, so one line changes.
            data = data.replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
        return data

    @overload
    async def next_event(self) -> h11.Event: ...
    @overload
    async def next_event(self, timeout_s: float) -> h11.Event | None: ...

    async def next_event(self, timeout_s: float = math.inf) -> h11.Event | None:
        """The peer's next event: a head, a piece of body, its end, or ``ConnectionClosed``;
        ``None`` if none was complete within ``timeout_s``. A checkpoint.

        Reads at most ``max_head_bytes`` at a time while a head is incomplete, and refuses a
        head larger than that even when it arrives in one read (h11 only checks incomplete
        heads). Raises ``h11.RemoteProtocolError`` (with ``error_status_hint``) for bytes that
        are not HTTP or break a limit, and :class:`ConnectionLost` if the peer reset the
        connection.
        """
        event = self.next_event_nowait()
        if event is not None:  # no timer for what is already here (a short request, usually)
            await trio.lowlevel.checkpoint()
            return event
        with trio.move_on_after(timeout_s):
            while event is None:
                await self._transport.wait_readable()
                event = self.next_event_nowait()
        return event

    def next_event_nowait(self) -> h11.Event | None:
        """The peer's next event if it is complete without waiting — already read, or whole in
        what the transport holds now — else ``None``. Not a checkpoint; raises as
        :meth:`next_event` does."""
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                in_head = self._h11.their_state in _HEAD_STATES
                data = self._transport.receive_now(
                    self.limits.max_head_bytes if in_head else self.limits.receive_bytes
                )
                if data is None:
                    return None
                if self._traffic is not None:
                    self._traffic.read += len(data)
                self._h11.receive_data(self._took(data, in_head))
                continue
            if event is h11.PAUSED:
                raise RuntimeError("a second request read before start_next_request: a bug")
            assert isinstance(event, h11.Event)
            if isinstance(event, h11.Request | h11.Response | h11.InformationalResponse):
                self._check_head_size()
            if isinstance(event, h11.Request):
                self.request_method = event.method
            return event

    def _check_head_size(self) -> None:
        buffered = len(self._h11.trailing_data[0])
        size = self._head_bytes - buffered
        self._head_bytes = buffered
        if size > self.limits.max_head_bytes:
            raise h11.RemoteProtocolError(
                f"the message head is {size} bytes, over the limit of "
                f"{self.limits.max_head_bytes} bytes",
                error_status_hint=431,
            )

    def _took(self, data: bytes, in_head: bool) -> bytes:
        if in_head:
            self._head_bytes += len(data)
            if len(self._first_bytes) < _METHOD_BYTES:
                self._first_bytes += data[: _METHOD_BYTES - len(self._first_bytes)]
        if not data:
            self.eof_received = True
        return data

    def start_next_request(self) -> bool:
        """Ready a client's connection for another request, once both messages of this one are
        complete and neither side asked to close; False (nothing changed) otherwise."""
        if self._lost or self._closed:
            return False
        if self._h11.our_state is not h11.DONE or self._h11.their_state is not h11.DONE:
            return False
        self._h11.start_next_cycle()
        self._head_bytes = len(self._h11.trailing_data[0])
        return True

    def idle_and_open(self) -> bool:
        """Whether a connection between requests is still usable: the peer has neither closed it
        nor sent anything unasked (either would make the next request's fate unknowable)."""
        if self._lost or self._closed or self._h11.trailing_data[0]:
            return False
        try:
            return self._transport.receive_now(1) is None
        except ConnectionLost:
            return False

    async def wait_until_peer_stops_sending(self) -> None:
        """Read and discard whatever the peer sends until it shuts down its sending side.

        For use once the peer's message is complete: later bytes (a pipelined request) are not
        fed to h11, which would refuse them. Returns on end-of-file, which is a *half*-close as
        often as a full close; raises :class:`ConnectionLost` on a reset. A checkpoint; can
        block forever against a peer that neither sends nor closes.
        """
        await self._discard_until_eof(math.inf)

    async def watch_peer(self, probe: Callable[[], Awaitable[None]] | None) -> None:
        """Raise :class:`ConnectionLost` once the peer is known to be gone; return when nothing
        more can be learned by watching (a server answering a whole request).

        An end-of-file is a half-close as often as a departure: ``probe`` — a write the peer's
        reader skips, a heartbeat — is made twice, :meth:`probe_delay_s` apart, and a departed
        peer's kernel answers the first with a reset, which the second meets. Without one (an
        HTTP/1.0 answer writes nothing before the answer) a reset is still noticed.
        """
        await self.wait_until_peer_stops_sending()
        if probe is None:
            return
        await probe()
        await trio.sleep(self.probe_delay_s())
        await probe()

    def probe_delay_s(self) -> float:
        """How long after the first probe write the second goes: twice the measured round trip
        and a millisecond (a departed peer's kernel answers the first with a reset within one
        round trip; the second and the millisecond absorb jitter and scheduling), never more
        than ``PROBE_DELAY_S`` — which is the delay when the transport does not say."""
        round_trip = self.round_trip_s()
        if round_trip is None:
            return PROBE_DELAY_S
        return min(PROBE_DELAY_S, 2 * round_trip + 0.001)

    async def close(self) -> None:
        """Close so that the peer reads everything we sent, then release the transport.

        Closing a socket whose input holds unread bytes makes the kernel send a reset, and a
        reset makes the *peer's* kernel drop our answer if it has not read it yet (measured:
        ``http.client`` uploading 50 MB saw ``ConnectionResetError`` instead of a 413). So: shut
        down our writing side, read and discard the peer's bytes until it closes, within
        ``drain_timeout_s`` and ``drain_max_bytes``, then close — unless the peer's message was
        read whole and nothing more is there: then nothing is unread, a close sends no reset,
        and waiting for the peer's end-of-file would only cost a round trip. Idempotent. A
        checkpoint; if cancelled, the transport is closed at once.
        """
        try:
            if not (self._lost or self._closed or self._nothing_unread()):
                with trio.move_on_after(self.limits.drain_timeout_s):
                    await self._transport.send_eof()
                    await self._discard_until_eof(self.limits.drain_max_bytes)
        except ConnectionLost:
            pass  # the peer left first: there is nothing left to protect
        finally:
            await self.aclose()

    def _nothing_unread(self) -> bool:
        """True if the peer's whole message was read and nothing has arrived after it (an
        end-of-file is nothing). Bytes found here are discarded, as the drain would."""
        if self._h11.trailing_data[0] or not (self.peer_is_done_sending or self.eof_received):
            return False
        try:
            return not self._transport.receive_now(self.limits.receive_bytes)
        except ConnectionLost:
            return False

    async def _discard_until_eof(self, max_bytes: float) -> None:
        """Raises :class:`ConnectionLost` on a reset."""
        discarded = 0
        while discarded <= max_bytes:
            await self._transport.wait_readable()
            data = self._transport.receive_now(self.limits.receive_bytes)
            if data == b"":
                self.eof_received = True
                return
            discarded += len(data or b"")

    async def aclose(self) -> None:
        """Close the transport at once, without draining; ``on_close`` is called first (it may
        not wait, so cancellation cannot skip it). Idempotent."""
        if not self._closed:
            self._closed = True
            if self._on_close is not None:
                self._on_close()
            await self._transport.aclose()
