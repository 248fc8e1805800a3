"""The h11 layer on its own: bounded shielded writes, head limits, body limits, framing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from tests.helpers import request_bytes
from trio_gym.errors import ErrorCode, WireError
from trio_gym.http import (
    ChunkedBody,
    ConnectionLost,
    HttpConnection,
    HttpLimits,
    read_body,
    read_request_head,
    send_body,
    send_empty,
)
from trio_gym.http.h11_build import h11
from trio_gym.http.transport import STREAM_BUFFER_BYTES, SocketTransport, StreamTransport


@asynccontextmanager
async def served_request(
    request: bytes, limits: HttpLimits | None = None, *, lockstep: bool = False
) -> AsyncIterator[tuple[HttpConnection, trio.abc.Stream, h11.Request]]:
    """A server connection over one of trio's own stream pairs with ``request`` read, its
    transport's sender running as :func:`~trio_gym.host.handle_connection` runs it."""
    limits = limits or HttpLimits()
    client, server = (
        trio.testing.lockstep_stream_pair() if lockstep else trio.testing.memory_stream_pair()
    )
    transport = StreamTransport(server, send_timeout_s=limits.send_timeout_s)
    conn = HttpConnection(transport, h11.SERVER, limits)
    refusal: WireError | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(transport.send_queued_forever)
        nursery.start_soon(client.send_all, request)
        try:
            head = await read_request_head(conn)
        except WireError as exc:
            refusal = exc
        else:
            yield conn, client, head
        nursery.cancel_scope.cancel()
    if refusal is not None:
        raise refusal


async def read_until(stream: trio.abc.ReceiveStream, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        data += await stream.receive_some(1)
    return data


async def test_a_write_cancelled_half_way_still_completes(autojump_clock: trio.abc.Clock) -> None:
    async with served_request(request_bytes(b"{}"), lockstep=True) as (conn, client, _):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_until, client, b"\r\n\r\n")  # the head, then nothing more
            body = await ChunkedBody.start(conn, 200, content_type="application/json")

        received: list[bytes] = []

        async def reader_who_comes_back_at_10_s() -> None:
            await trio.sleep(10)
            received.append(await read_until(client, b"0\r\n\r\n"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader_who_comes_back_at_10_s)
            with trio.move_on_after(5):  # the heartbeat's owner is cancelled while its write waits
                await body.send(b" ")
            await body.finish()
        # The cancelled heartbeat went out whole, then the zero-length chunk: framing intact.
        assert received == [b"1\r\n \r\n0\r\n\r\n"]


async def test_a_shielded_write_is_bounded_by_send_timeout(autojump_clock: trio.abc.Clock) -> None:
    limits = HttpLimits(send_timeout_s=30)
    async with served_request(request_bytes(b"{}"), limits, lockstep=True) as (conn, client, _):
        start = trio.current_time()
        # More than the transport's buffer and the write its sender holds; nobody reads; it
        # is cancelled at 1 s and given up at 30 s.
        body = b"y" * (4 * STREAM_BUFFER_BYTES)
        with pytest.raises(ConnectionLost, match=r"did not read for 30 s"), trio.move_on_after(1):
            await send_body(conn, 200, body, content_type="text/plain")
        assert trio.current_time() - start == 30
        assert conn.lost
        with pytest.raises(ConnectionLost):
            await send_empty(conn, 200)


@pytest.mark.parametrize("version", ["1.0", "1.1"])
async def test_send_empty_frames_by_content_length_zero(version: str) -> None:
    async with served_request(request_bytes(method="OPTIONS", version=version)) as (
        conn,
        client,
        _,
    ):
        await send_empty(conn, 200)
        raw = await client.receive_some(1000)
        assert b"\r\ncontent-length: 0\r\n" in raw
        assert b"transfer-encoding" not in raw


async def test_chunked_body_refuses_an_http_10_peer() -> None:
    async with served_request(request_bytes(b"{}", version="1.0")) as (conn, _, _):
        with pytest.raises(RuntimeError, match=r"HTTP/1\.1"):
            await ChunkedBody.start(conn, 200, content_type="application/json")


async def test_the_head_limit_holds_even_when_the_head_arrives_in_one_read() -> None:
    limits = HttpLimits(max_head_bytes=1024)
    base = request_bytes(method="GET", target="/health", headers=[("X-Pad", "")])
    fits = base.replace(b"X-Pad: ", b"X-Pad: " + b"a" * (1024 - len(base)))
    assert len(fits) == 1024
    async with served_request(fits, limits):
        pass
    too_big = fits.replace(b"X-Pad: ", b"X-Pad: a")
    with pytest.raises(WireError) as refusal:
        async with served_request(too_big, limits):
            pass
    assert refusal.value.code is ErrorCode.HEADERS_TOO_LARGE


async def test_a_declared_length_over_the_limit_is_refused_before_reading_the_body(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Only the head is sent: a refusal that waited for body bytes would never come.
    async with served_request(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 101\r\n\r\n") as (
        conn,
        client,
        head,
    ):
        start = trio.current_time()
        with pytest.raises(WireError) as refusal:
            await read_body(conn, head, max_bytes=100, idle_timeout_s=5, advice="send less")
        assert refusal.value.status == 413
        assert refusal.value.message.endswith("; send less")
        assert trio.current_time() == start


async def test_a_chunked_body_is_refused_as_soon_as_it_grows_past_the_limit() -> None:
    async with served_request(
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + b"3c\r\n" + b"x" * 60
    ) as (conn, client, head):
        with pytest.raises(WireError) as refusal:
            await read_body(conn, head, max_bytes=50, idle_timeout_s=5)
        assert refusal.value.status == 413


async def test_send_timeout_bounds_a_stall_not_a_slow_steady_reader(
    autojump_clock: trio.abc.Clock,
) -> None:
    limits = HttpLimits(send_timeout_s=1)
    async with served_request(request_bytes(b"{}"), limits, lockstep=True) as (conn, client, _):
        received = bytearray()

        async def slow_reader() -> None:
            while True:  # 64 KiB every 0.1 s: 640 KiB/s, so a 2 MiB body takes over 3 s
                data = await client.receive_some(64 * 1024)
                if not data:
                    return
                received.extend(data)
                await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_reader)
            await send_body(conn, 200, b"y" * (2 * 1024 * 1024), content_type="text/plain")
            await conn.aclose()
        assert received.endswith(b"y" * 1000) and len(received) > 2 * 1024 * 1024


async def test_a_body_larger_than_the_socket_buffer_arrives_whole_over_tcp() -> None:
    """Writes try the kernel's buffer first and wait only for what it did not take: a body
    far larger than the buffer, to a reader that starts late, arrives whole and in order."""
    body = bytes(range(256)) * (32 * 1024)  # 8 MiB
    received = bytearray()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def reader(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        task_status.started()
        async with stream:
            await stream.send_all(request_bytes(b"{}"))
            await trio.sleep(0.3)  # the writer fills the buffer meanwhile
            while data := await stream.receive_some(65536):
                received.extend(data)

    with trio.fail_after(30):  # a hang guard only
        async with listeners[0], trio.open_nursery() as nursery:
            await nursery.start(reader)
            server = await listeners[0].accept()
            conn = HttpConnection(SocketTransport(server.socket), h11.SERVER, HttpLimits())
            await read_request_head(conn)
            await send_body(conn, 200, body, content_type="application/octet-stream")
            await conn.aclose()
    assert received.endswith(b"\r\n\r\n" + body)


async def _chunked_answer_over_a_socketpair(
    limits: HttpLimits,
) -> tuple[ChunkedBody, HttpConnection, trio.SocketStream]:
    """A started chunked answer on one end of a socket pair with small kernel buffers."""
    import socket

    server_sock, client_sock = trio.socket.socketpair()
    server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    server, client = trio.SocketStream(server_sock), trio.SocketStream(client_sock)
    conn = HttpConnection(SocketTransport(server.socket), h11.SERVER, limits)
    await client.send_all(request_bytes(b"{}"))
    head = await read_request_head(conn)
    await read_body(conn, head, max_bytes=100, idle_timeout_s=5)
    return await ChunkedBody.start(conn, 200, content_type="text/plain"), conn, client


async def test_a_write_without_waiting_owes_what_the_kernel_did_not_take() -> None:
    body, conn, client = await _chunked_answer_over_a_socketpair(HttpLimits())
    sent = bytearray()
    piece = b"z" * 10_000
    async with client:
        while body.send_nowait(piece):  # True: written, the kernel's leftover owed
            sent += piece
            if len(sent) > 10_000_000:
                raise AssertionError("the kernel never filled up")
        assert not body.send_nowait(piece)  # owed bytes first: nothing more taken, nothing sent
        received = bytearray()

        async def read_all() -> None:
            while data := await client.receive_some(65536):
                received.extend(data)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await body.finish(b"end")  # pays what is owed, then the rest
            await conn.aclose()
    reply = bytes(received)
    decoded = h11.Connection(h11.CLIENT)
    decoded.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    decoded.send(h11.EndOfMessage())
    decoded.receive_data(reply)
    decoded.receive_data(b"")
    data = bytearray()
    while not isinstance(event := decoded.next_event(), h11.EndOfMessage):
        if isinstance(event, h11.Data):
            data += event.data
    assert bytes(data) == bytes(sent) + b"end"


async def test_bytes_owed_for_send_timeout_mean_the_peer_is_gone() -> None:
    body, conn, client = await _chunked_answer_over_a_socketpair(HttpLimits(send_timeout_s=0.2))
    async with client:
        while body.send_nowait(b"z" * 10_000):
            pass
        await trio.sleep(0.3)  # the peer reads nothing
        with pytest.raises(ConnectionLost, match="did not read"):
            body.send_nowait(b"z")
        assert conn.lost
        await conn.aclose()


async def _tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """The server's and the client's end of one loopback TCP connection."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listeners[0]:
        port = listeners[0].socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listeners[0].accept()
    return server, client


async def test_a_request_read_whole_is_closed_without_waiting_for_the_callers_close() -> None:
    """Nothing unread, nothing arriving: the close sends no reset, so the caller's end-of-file
    is not waited for (a round trip per answer, and the drain's timer)."""
    server, client = await _tcp_pair()
    conn = HttpConnection(
        SocketTransport(server.socket), h11.SERVER, HttpLimits(drain_timeout_s=3600)
    )
    async with client:
        await client.send_all(request_bytes(b"{}"))
        head = await read_request_head(conn)
        await read_body(conn, head, max_bytes=100, idle_timeout_s=5)
        await send_body(conn, 200, b"whole", content_type="text/plain")
        with trio.fail_after(10):  # the caller never closes: only the drain would wait here
            await conn.close()
        reply = bytearray()
        while data := await client.receive_some(65536):
            reply += data
    assert reply.endswith(b"\r\n\r\nwhole")


async def test_every_read_and_write_of_a_short_exchange_is_a_checkpoint() -> None:
    """Data already in the socket and room in its buffer still yield to the scheduler: every
    async call is a checkpoint, however little it has to wait."""
    server_sock, client_sock = trio.socket.socketpair()
    server, client = trio.SocketStream(server_sock), trio.SocketStream(client_sock)
    conn = HttpConnection(SocketTransport(server.socket), h11.SERVER, HttpLimits())
    async with client, server:
        await client.send_all(request_bytes(b"{}"))
        await trio.sleep(0.01)  # the whole request is in the socket
        with trio.testing.assert_checkpoints():
            head = await read_request_head(conn)
        with trio.testing.assert_checkpoints():
            await read_body(conn, head, max_bytes=100, idle_timeout_s=5)
        with trio.testing.assert_checkpoints():
            body = await ChunkedBody.start(conn, 200, content_type="text/plain")
        with trio.testing.assert_checkpoints():
            await body.send(b"y")


async def test_a_socket_write_cancelled_half_way_still_completes() -> None:
    """The write span's shield on a socket: cancelled while the kernel's buffer is full, the
    chunk still goes out whole before the next one (a stream's transport shields its own sends;
    a socket's has only the connection's shield)."""
    body, conn, client = await _chunked_answer_over_a_socketpair(HttpLimits())
    piece = b"x" * 200_000
    received = bytearray()

    async def reader_who_comes_back_later() -> None:
        await trio.sleep(0.5)
        while data := await client.receive_some(65536):
            received.extend(data)

    async with client, trio.open_nursery() as nursery:
        nursery.start_soon(reader_who_comes_back_later)
        with trio.move_on_after(0.2):  # the buffer is full long before
            await body.send(piece)
        await body.finish(b"end")
        await conn.aclose()
    decoded = h11.Connection(h11.CLIENT)
    decoded.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    decoded.send(h11.EndOfMessage())
    decoded.receive_data(bytes(received))
    decoded.receive_data(b"")
    data = bytearray()
    while not isinstance(event := decoded.next_event(), h11.EndOfMessage):
        if isinstance(event, h11.Data):
            data += event.data
    assert bytes(data) == piece + b"end"


async def test_a_stream_transport_queues_no_more_than_its_buffer() -> None:
    """Writes without waiting to a stream whose peer reads nothing stop at ``buffer_bytes``, as a
    socket's stop at its kernel buffer: a heartbeat cannot grow memory without bound."""
    _, server = trio.testing.lockstep_stream_pair()
    transport = StreamTransport(server, send_timeout_s=30, buffer_bytes=1000)
    assert transport.write_now(b"x" * 600) == 600
    assert transport.write_now(b"x" * 600) == 400
    assert transport.write_now(b"x") == 0
    assert transport.queued_bytes == 1000
