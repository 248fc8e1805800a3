"""One h11 connection over one trio stream: serialised, bounded writes and size-limited reads.

This is the only place bytes meet a stream. It knows nothing of routes or documents; both the
host and the trainer client drive their exchanges through it.
"""

from __future__ import annotations

import math
import os
import socket
import struct
from collections.abc import Callable
from typing import Final, Protocol, runtime_checkable

import h11
import trio

from trio_gym.http.limits import HttpLimits

Role = type[h11.CLIENT] | type[h11.SERVER]

# States in which the peer's next bytes belong to a message head.
_HEAD_STATES: Final = (h11.IDLE, h11.SEND_RESPONSE)
# How much of a connection's traffic may be read and written without a checkpoint (see
# _read_now and send): a short exchange, never a long one that would keep other tasks waiting.
UNYIELDING_BYTES: Final = 64 * 1024
# Linux's struct tcp_info: eight one-byte fields, then 32-bit ones; tcpi_rtt (microseconds) is
# the sixteenth of those.
_TCP_INFO: Final = getattr(socket, "TCP_INFO", None)
_TCPI_RTT_OFFSET: Final = 8 + 15 * 4
_TCP_INFO_BYTES: Final = _TCPI_RTT_OFFSET + 4
# Enough of a request's first bytes to hold any method name and the space after it.
_METHOD_BYTES: Final = 16


class ConnectionLost(Exception):
    """The peer is gone (reset, broken pipe) or stopped reading for ``send_timeout_s``.

    Nothing more can be exchanged on this connection; the only thing left to do is close it.
    """


@runtime_checkable
class WritesWithoutWaiting(Protocol):
    """A stream that can hand bytes to its transport without waiting, as a socket's
    non-blocking write does: :meth:`write_nowait` takes what fits now and says how much (0 when
    full), and raises ``trio.BrokenResourceError`` once the peer is gone. ``trio.SocketStream``
    is written this way directly; another stream opts in by having the method (the in-memory
    streams of the virtual-clock tests do, so their heartbeats take production's road)."""

    def write_nowait(self, data: bytes) -> int: ...


def _nowait_writer(stream: trio.abc.Stream) -> Callable[[bytes], int] | None:
    if isinstance(stream, trio.SocketStream):
        socket = stream.socket
        # fileno() at each write, never kept: after a close it is -1 (a clean EBADF), where a
        # kept number could by then belong to another file.
        return lambda data: os.write(socket.fileno(), data)
    if isinstance(stream, WritesWithoutWaiting):
        return stream.write_nowait
    return None


class HttpConnection:
    """An HTTP/1.x exchange over ``stream``, as ``role`` (``h11.CLIENT`` or ``h11.SERVER``).

    Writes go through :meth:`send`, reads through :meth:`next_event`. One task may read while
    another writes; concurrent writers are serialised. A client may send its request as
    ``request_version=b"1.0"``.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        role: Role,
        limits: HttpLimits,
        *,
        request_version: bytes = b"1.1",
    ) -> None:
        self.limits = limits
        self._request_version = request_version
        self._stream = stream
        self._write_nowait = _nowait_writer(stream)
        self._h11 = h11.Connection(role, max_incomplete_event_size=limits.max_head_bytes)
        self._send_lock = trio.StrictFIFOLock()
        self._head_bytes = 0
        self._lost = False
        self._closed = False
        self._unyielding_left = UNYIELDING_BYTES
        self._owed = b""
        """Bytes h11 considers sent that the kernel has not taken yet (see send_nowait)."""
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
        """The kernel's smoothed round-trip time to the peer, in seconds (``TCP_INFO``'s
        ``tcpi_rtt``); ``None`` where it does not say (not TCP, not Linux, no sample yet)."""
        if not isinstance(self._stream, trio.SocketStream) or _TCP_INFO is None:
            return None
        try:
            info = self._stream.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
        except OSError:
            return None
        if len(info) < _TCP_INFO_BYTES:
            return None
        (rtt_us,) = struct.unpack_from("I", info, _TCPI_RTT_OFFSET)
        return rtt_us / 1e6 if rtt_us else None

    @property
    def lost(self) -> bool:
        """True once a write failed or stalled: the peer can no longer be reached."""
        return self._lost

    async def send(self, *events: h11.Event) -> None:
        """Write ``events`` whole and in order, with no other write between them.

        Events are written in runs of about ``write_bytes``, each its own write bounded by
        ``send_timeout_s``, so the bound means "the peer took nothing for that long", not "all
        of it within that long". The whole span is shielded from cancellation: cancelled
        half-way, h11 would believe bytes went out that never did (the final document after a
        heartbeat would be refused or corrupt the framing), and a line of a row stream would be
        left half-written. The shield hangs no one: every write inside it is bounded. (Only a
        write that has to wait needs it: the others have no checkpoint to be cancelled at.)

        A checkpoint — but for the first ``UNYIELDING_BYTES`` of a connection's traffic, when
        no other write is under way and the kernel takes everything at once: a short answer
        then costs no trip through the scheduler. ``Cancelled`` can only be raised before the
        lock is taken (nothing written) or after everything was written. Raises
        :class:`ConnectionLost` if the peer is gone or took nothing for ``send_timeout_s``; the
        connection is then unusable. ``h11.LocalProtocolError`` means the caller broke HTTP: a
        bug, not the peer's doing.
        """
        if self._send_lock.locked() or self._unyielding_left <= 0:
            async with self._send_lock:
                await self._send_events(events)
            return
        self._send_lock.acquire_nowait()  # free, and no checkpoint since we looked
        try:
            await self._send_events(events)
        finally:
            self._send_lock.release()

    async def _send_events(self, events: tuple[h11.Event, ...]) -> None:
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

    @property
    def can_send_nowait(self) -> bool:
        """True if :meth:`send_nowait` can write at all (a socket, or a stream that
        :class:`WritesWithoutWaiting`)."""
        return self._write_nowait is not None

    def send_nowait(self, *events: h11.Event) -> bool:
        """Write ``events`` now, without waiting, when that is possible: the stream is a
        socket, no other write is in progress and nothing is owed from before. Returns False
        otherwise, having written and changed nothing. Not a checkpoint.

        Only for events that leave h11's state as it was (chunks of a body): what the kernel
        does not take at once is *owed* and goes out first in the next write of either kind.
        This is how heartbeats are written — one system call each, where :meth:`send` costs a
        lock, a cancel scope and a task switch, which ten thousand connections beating every
        second cannot afford. Raises :class:`ConnectionLost` if the peer is gone, or has taken
        none of what is owed for ``send_timeout_s``.
        """
        if self._lost:
            raise ConnectionLost("an earlier write to this peer failed")
        if self._send_lock.locked() or not self.can_send_nowait:
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
        sent = self._write_now(data)
        if sent == len(data):
            return
        data = data[sent:]
        # Shielded (see send); most writes fit the socket's buffer and never get here.
        with trio.CancelScope(shield=True), trio.move_on_after(self.limits.send_timeout_s) as scope:
            try:
                await self._stream.send_all(data)
            except trio.BrokenResourceError as exc:
                self._lost = True
                raise ConnectionLost(f"the peer is gone ({exc.__cause__ or exc})") from exc
        if scope.cancelled_caught:
            self._lost = True
            raise ConnectionLost(
                f"the peer did not read for {self.limits.send_timeout_s:g} s (send_timeout_s)"
            )

    def _write_now(self, data: bytes) -> int:
        """Write what a socket's buffer takes at once, without waiting; how much was written.

        Most writes (a heartbeat, a row, a small answer) fit in the kernel's buffer: this spares
        them a timeout scope and a trip through the scheduler, which is most of what a
        heartbeat costs when ten thousand connections beat every second. A stream that cannot
        be written without waiting (TLS, say) takes the general path.
        """
        if self._write_nowait is None:
            return 0
        try:
            sent = self._write_nowait(data)
        except BlockingIOError:
            return 0
        except (OSError, trio.BrokenResourceError) as exc:
            self._lost = True
            raise ConnectionLost(f"the peer is gone ({exc})") from exc
        self._unyielding_left -= sent
        return sent

    def _bytes_of(self, event: h11.Event) -> bytes:
        data = self._h11.send(event) or b""
        if isinstance(event, h11.Request) and self._request_version == b"1.0":
            # h11 writes only HTTP/1.1 request lines; everything else it writes for a request
            # (Host, Content-Length, Connection: close) is valid HTTP/1.0, so one line changes.
            data = data.replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
        return data

    async def next_event(self) -> h11.Event:
        """The peer's next event: a head, a piece of body, its end, or ``ConnectionClosed``.

        Blocks until one is complete; put a deadline around it. Reads at most
        ``max_head_bytes`` at a time while a head is incomplete, and refuses a head larger than
        that even when it arrives in one read (h11 only checks incomplete heads).

        Raises ``h11.RemoteProtocolError`` (with ``error_status_hint``) for bytes that are not
        HTTP or break a limit, and :class:`ConnectionLost` if the peer reset the connection.
        """
        while (event := self.next_event_nowait()) is None:
            self._h11.receive_data(await self._receive())
        return event

    def next_event_nowait(self) -> h11.Event | None:
        """The peer's next event if it is complete without waiting — already read, or whole in
        what the socket holds now (see :meth:`_read_now`) — else ``None``. Not a checkpoint;
        raises as :meth:`next_event` does. A short request's head and body are usually here
        at once, and need no timer then."""
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                in_head, max_bytes = self._reading()
                data = self._read_now(max_bytes)
                if data is None:
                    return None
                self._h11.receive_data(self._took(data, in_head))
                continue
            if event is h11.PAUSED:
                raise RuntimeError("connections are never reused; a second cycle is a bug")
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

    def _reading(self) -> tuple[bool, int]:
        """Whether the next bytes belong to a head, and how many to read at most."""
        in_head = self._h11.their_state in _HEAD_STATES
        return in_head, self.limits.max_head_bytes if in_head else self.limits.receive_bytes

    async def _receive(self) -> bytes:
        in_head, max_bytes = self._reading()
        try:
            data = await self._stream.receive_some(max_bytes)
        except trio.BrokenResourceError as exc:
            raise ConnectionLost(f"the peer reset the connection ({exc.__cause__ or exc})") from exc
        return self._took(data, in_head)

    def _took(self, data: bytes | bytearray, in_head: bool) -> bytes:
        if in_head:
            self._head_bytes += len(data)
            if len(self._first_bytes) < _METHOD_BYTES:
                self._first_bytes += data[: _METHOD_BYTES - len(self._first_bytes)]
        if not data:
            self.eof_received = True
        return bytes(data)  # no copy when it already is bytes, as from a socket

    def _read_now(self, max_bytes: int) -> bytes | None:
        """What a socket holds now (``b""`` at its end-of-file), read without a checkpoint;
        ``None`` when nothing is there or the stream is not a socket.

        A short request is one read that needs no waiting, and trio's read would add a trip
        through the scheduler to it. Only the first ``UNYIELDING_BYTES`` of a connection are read
        this way (a budget shared with writes): past them every read is a
        checkpoint again, so a peer sending fast cannot keep its task from yielding to others.
        """
        if self._unyielding_left <= 0 or not isinstance(self._stream, trio.SocketStream):
            return None
        try:
            data = os.read(self._stream.socket.fileno(), max_bytes)
        except OSError:  # nothing yet (EAGAIN), or an error trio's read will name
            return None
        self._unyielding_left -= len(data)
        return data

    async def wait_until_peer_stops_sending(self) -> None:
        """Read and discard whatever the peer sends until it shuts down its sending side.

        For use once the peer's message is complete: later bytes (a pipelined request) are not
        fed to h11, which would refuse them. Returns on end-of-file, which is a *half*-close as
        often as a full close; raises :class:`ConnectionLost` on a reset. A checkpoint; can
        block forever against a peer that neither sends nor closes.

        On a socket it waits for readability itself, where trio's read would keep four more
        frames and two context managers alive for as long as the batch is held.
        """
        if not isinstance(self._stream, trio.SocketStream):
            try:
                await self._discard_until_eof(math.inf)
            except trio.BrokenResourceError as exc:
                raise ConnectionLost(
                    f"the peer reset the connection ({exc.__cause__ or exc})"
                ) from exc
            return
        while True:
            await trio.lowlevel.wait_readable(self._stream.socket)
            try:
                if not os.read(self._stream.socket.fileno(), self.limits.receive_bytes):
                    return
            except BlockingIOError:
                continue
            except OSError as exc:
                raise ConnectionLost(f"the peer reset the connection ({exc})") from exc

    async def close(self) -> None:
        """Close so that the peer reads everything we sent, then release the stream.

        Closing a socket whose input holds unread bytes makes the kernel send a reset, and a
        reset makes the *peer's* kernel drop our answer if it has not read it yet (measured:
        ``http.client`` uploading 50 MB saw ``ConnectionResetError`` instead of a 413). So: shut
        down our writing side, read and discard the peer's bytes until it closes, within
        ``drain_timeout_s`` and ``drain_max_bytes``, then close — unless the peer's message was
        read whole and nothing more waits in the socket: then nothing is unread, a close sends
        no reset, and waiting for the peer's end-of-file would only cost a round trip.
        Idempotent. A checkpoint; if cancelled, the stream is closed at once.
        """
        try:
            drain = not (self._lost or self._closed or self._nothing_unread())
            if drain and isinstance(self._stream, trio.abc.HalfCloseableStream):
                with trio.move_on_after(self.limits.drain_timeout_s):
                    await self._stream.send_eof()
                    await self._discard_until_eof(self.limits.drain_max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer left first: there is nothing left to protect
        finally:
            await self.aclose()

    def _nothing_unread(self) -> bool:
        """True if the peer's whole message was read and its socket holds no byte after it
        (an end-of-file is no byte). A socket only: another stream cannot be looked into
        without waiting. Bytes found here are discarded, as the drain would."""
        if not isinstance(self._stream, trio.SocketStream) or self._h11.trailing_data[0]:
            return False
        if not (self.peer_is_done_sending or self.eof_received):
            return False
        try:
            return not os.read(self._stream.socket.fileno(), self.limits.receive_bytes)
        except BlockingIOError:
            return True
        except OSError:
            return False

    async def _discard_until_eof(self, max_bytes: float) -> None:
        discarded = 0
        while discarded <= max_bytes:
            data = await self._stream.receive_some(self.limits.receive_bytes)
            if not data:
                return
            discarded += len(data)

    async def aclose(self) -> None:
        """Close the stream at once, without draining. Idempotent."""
        if not self._closed:
            self._closed = True
            await self._stream.aclose()
