"""In-memory connections that behave as sockets do where the host relies on it.

The virtual-clock tests cannot use real sockets (an autojump clock leaps while the kernel
works), and trio's memory streams cannot be written without waiting, which is how the host
writes every heartbeat. :func:`socket_like_pair` gives both ends of a connection whose writes
land in a bounded buffer, as a kernel's would: :meth:`SocketLikeStream.write_nowait` takes what
fits now (the host's heartbeats then take production's road, the pacer's), ``send_all`` waits
for room, and a reader waiting in ``receive_some`` takes bytes straight from the writer.
``capacity=0`` is a lockstep pair: nothing moves unless the peer is reading — a caller that
stops reading stalls the next write at once.
"""

from __future__ import annotations

import math

import trio
import trio.lowlevel


class _Direction:
    """The bytes on their way from one end to the other."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.buffer = bytearray()
        self.reader_wants = 0
        self.writer_done = False  # end-of-file once the buffer is read
        self.reader_gone = False  # writes fail: the peer closed
        self.readable = trio.lowlevel.ParkingLot()
        self.writable = trio.lowlevel.ParkingLot()

    def room(self) -> float:
        return self.capacity + self.reader_wants - len(self.buffer)


class SocketLikeStream(trio.abc.HalfCloseableStream):
    def __init__(self, outgoing: _Direction, incoming: _Direction) -> None:
        self._out = outgoing
        self._in = incoming
        self._closed = False

    def write_nowait(self, data: bytes) -> int:
        """Take what fits now; raises ``trio.BrokenResourceError`` once the peer has closed."""
        if self._closed:
            raise trio.ClosedResourceError("this end is closed")
        if self._out.reader_gone:
            raise trio.BrokenResourceError("the peer closed the connection")
        if self._out.writer_done:
            raise trio.ClosedResourceError("this end already sent end-of-file")
        taken = int(min(len(data), max(self._out.room(), 0)))
        if taken:
            self._out.buffer += data[:taken]
            self._out.readable.unpark_all()
        return taken

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        rest = bytes(data)
        while True:
            rest = rest[self.write_nowait(rest) :]
            if not rest:
                return
            await self._out.writable.park()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()
        while self._out.room() <= 0 and not self._out.reader_gone:
            await self._out.writable.park()

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise trio.ClosedResourceError("this end is closed")
        self._out.writer_done = True
        self._out.readable.unpark_all()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        wants = max_bytes if max_bytes is not None else 65536
        while not self._in.buffer and not self._in.writer_done:
            if self._closed:
                raise trio.ClosedResourceError("this end is closed")
            self._in.reader_wants = wants
            self._in.writable.unpark_all()  # a waiting writer may hand its bytes straight over
            try:
                await self._in.readable.park()
            finally:
                self._in.reader_wants = 0
        data = bytes(self._in.buffer[:wants])
        del self._in.buffer[:wants]
        self._in.writable.unpark_all()
        await trio.lowlevel.cancel_shielded_checkpoint()
        return data

    def close(self) -> None:
        """Close this end at once (what a process's death does to its pipes)."""
        self._closed = True
        self._out.writer_done = True
        self._in.reader_gone = True
        self._in.buffer.clear()
        for direction in (self._out, self._in):
            direction.readable.unpark_all()
            direction.writable.unpark_all()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()


def socket_like_pair(capacity: float = math.inf) -> tuple[SocketLikeStream, SocketLikeStream]:
    """Two connected ends; each direction buffers up to ``capacity`` bytes (unbounded by
    default, as trio's memory streams)."""
    there, back = _Direction(capacity), _Direction(capacity)
    return SocketLikeStream(there, back), SocketLikeStream(back, there)
