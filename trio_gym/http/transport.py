"""What an HTTP connection needs from the bytes under it, for a socket and for any trio stream.

:class:`~trio_gym.http.HttpConnection` talks only to a :class:`Transport`: take what has arrived,
write what fits, wait until either can make progress, close. The synchronous half never waits
and is never a checkpoint (a heartbeat is one write of a few bytes, ten thousand a second); the
asynchronous half always is one.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Final, Protocol

import trio

from trio_gym.changes import Changes

# Linux's struct tcp_info: eight one-byte fields, then 32-bit ones; tcpi_rtt (microseconds) is
# the sixteenth of those.
_TCP_INFO: Final = getattr(socket, "TCP_INFO", None)
_TCPI_RTT_OFFSET: Final = 8 + 15 * 4
_TCP_INFO_BYTES: Final = _TCPI_RTT_OFFSET + 4
# What a stream's transport holds for its peer beyond the write under way, as a kernel's send
# buffer would (a Linux socket's starts near this size).
STREAM_BUFFER_BYTES: Final = 64 * 1024


class ConnectionLost(Exception):
    """The peer is gone (reset, broken pipe) or stopped reading for ``send_timeout_s``.

    Nothing more can be exchanged on this connection; the only thing left to do is close it.
    """


class Transport(Protocol):
    def receive_now(self, max_bytes: int) -> bytes | None:
        """What has arrived, up to ``max_bytes``; ``b""`` at the peer's end-of-file; ``None``
        when nothing is there yet. Raises :class:`ConnectionLost` on a reset."""
        ...

    def write_now(self, data: bytes) -> int:
        """Hand over what fits now; how many bytes of ``data`` were taken (0 when full).
        Raises :class:`ConnectionLost` once the peer is gone."""
        ...

    @property
    def queued_bytes(self) -> int:
        """How much :meth:`write_now` took that is still held here, not yet handed to the
        stream (a socket's kernel holds what it takes: always 0 there)."""
        ...

    async def wait_readable(self) -> None:
        """Until :meth:`receive_now` has something to say (bytes, end-of-file or a reset)."""
        ...

    async def wait_writable(self) -> None:
        """Until :meth:`write_now` can take a byte, or will raise; nothing is queued then."""
        ...

    async def send_eof(self) -> None:
        """Shut down the writing side once everything written has gone out (a half-close)."""
        ...

    def round_trip_s(self) -> float | None:
        """The smoothed round trip to the peer, where the transport knows it."""
        ...

    async def aclose(self) -> None:
        """Close; nothing more is read or written. Idempotent."""
        ...


class SocketTransport:
    """A connected socket, read and written with one system call each: trio's ``SocketStream``
    adds a cancel scope, a conflict detector and a trip through the scheduler to each."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._socket = sock

    def receive_now(self, max_bytes: int) -> bytes | None:
        try:
            # fileno() at each call, never kept: after a close it is -1 (a clean EBADF), where
            # a kept number could by then belong to another file.
            return os.read(self._socket.fileno(), max_bytes)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise ConnectionLost(f"the peer reset the connection ({exc})") from exc

    def write_now(self, data: bytes) -> int:
        try:
            return os.write(self._socket.fileno(), data)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise ConnectionLost(f"the peer is gone ({exc})") from exc

    queued_bytes: Final = 0

    async def wait_readable(self) -> None:
        await trio.lowlevel.wait_readable(self._socket)

    async def wait_writable(self) -> None:
        await trio.lowlevel.wait_writable(self._socket)

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        try:
            self._socket.shutdown(socket.SHUT_WR)
        except OSError as exc:
            raise ConnectionLost(f"the peer is gone ({exc})") from exc

    def round_trip_s(self) -> float | None:
        """``TCP_INFO``'s ``tcpi_rtt``; ``None`` where the kernel does not say (not TCP, not
        Linux, no sample yet)."""
        if _TCP_INFO is None:
            return None
        try:
            info = self._socket.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
        except OSError:
            return None
        if len(info) < _TCP_INFO_BYTES:
            return None
        (rtt_us,) = struct.unpack_from("I", info, _TCPI_RTT_OFFSET)
        return rtt_us / 1e6 if rtt_us else None

    async def aclose(self) -> None:
        self._socket.close()  # trio's close wakes whoever waits on it first
        await trio.lowlevel.checkpoint()


class StreamTransport:
    """Any trio stream (a memory stream in a test, TLS in an embedder's server).

    A stream cannot be written without waiting, so :meth:`write_now` queues, as a kernel's send
    buffer does, up to ``buffer_bytes``. What is queued goes out at the owner's next wait on the
    transport (each asynchronous method sends it first), and through
    :meth:`send_queued_forever`, which a server runs beside a connection whose task waits on
    other things (its examples, say) while heartbeats are queued.

    Each send is shielded (a write cancelled half-way would leave the peer a partial chunk) and
    bounded by ``send_timeout_s``, after which the peer is given up as it is on a socket.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        send_timeout_s: float,
        buffer_bytes: int = STREAM_BUFFER_BYTES,
    ) -> None:
        if buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be at least 1, not {buffer_bytes}")
        self._stream = stream
        self._send_timeout_s = send_timeout_s
        self._buffer_bytes = buffer_bytes
        self._queued = bytearray()
        self._queued_changes = Changes()
        self._sending = trio.Lock()
        self._received = b""
        self._eof = False
        self._broken: ConnectionLost | None = None
        self._closed = False

    def receive_now(self, max_bytes: int) -> bytes | None:
        if self._received:
            data, self._received = self._received[:max_bytes], self._received[max_bytes:]
            return data
        if self._broken is not None and not self._eof:
            raise self._broken
        return b"" if self._eof else None

    def write_now(self, data: bytes) -> int:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise ConnectionLost("the connection is closed")
        taken = max(0, min(len(data), self._buffer_bytes - len(self._queued)))
        if taken:
            self._queued += data[:taken]
            self._queued_changes.note()
        return taken

    @property
    def queued_bytes(self) -> int:
        return len(self._queued)

    async def wait_readable(self) -> None:
        await self._send_queued()
        if self._received or self._eof or self._broken is not None:
            return
        try:
            data = await self._stream.receive_some()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._broken = ConnectionLost(f"the peer reset the connection ({exc})")
            return
        self._received += data
        self._eof = not data

    async def wait_writable(self) -> None:
        await self._send_queued()

    async def send_queued_forever(self) -> None:
        """Send what :meth:`write_now` queues as it is queued, until cancelled or the peer is
        gone."""
        while self._broken is None:
            await self._queued_changes.until(lambda: bool(self._queued))
            await self._send_queued()

    async def _send_queued(self) -> None:
        async with self._sending:
            while self._queued and self._broken is None:
                data = bytes(self._queued)
                self._queued.clear()
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(self._send_timeout_s) as scope:
                        try:
                            await self._stream.send_all(data)
                        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                            self._broken = ConnectionLost(f"the peer is gone ({exc})")
                if scope.cancelled_caught:
                    self._broken = ConnectionLost(
                        f"the peer did not read for {self._send_timeout_s:g} s (send_timeout_s)"
                    )
            if self._broken is not None:
                self._queued.clear()  # nothing more can go out

    async def send_eof(self) -> None:
        await self._send_queued()
        if self._broken is not None:
            raise self._broken
        if isinstance(self._stream, trio.abc.HalfCloseableStream):
            try:
                await self._stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ConnectionLost(f"the peer is gone ({exc})") from exc

    def round_trip_s(self) -> float | None:
        return None

    async def aclose(self) -> None:
        """Send what is queued first, as a socket's kernel sends its buffer after a close
        (within ``send_timeout_s``; at once if cancelled), then close the stream."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        try:
            await self._send_queued()
        finally:
            self._closed = True
            self._queued.clear()
            await trio.aclose_forcefully(self._stream)


def transport_of(
    stream: trio.abc.Stream, *, send_timeout_s: float, buffer_bytes: int = STREAM_BUFFER_BYTES
) -> SocketTransport | StreamTransport:
    """The transport for ``stream``: a socket's own, or the general one (``buffer_bytes`` is
    how much it queues)."""
    if isinstance(stream, trio.SocketStream):
        return SocketTransport(stream.socket)
    return StreamTransport(stream, send_timeout_s=send_timeout_s, buffer_bytes=buffer_bytes)
