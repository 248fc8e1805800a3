"""Keep-alive toward a server (the agents runner's connections to Gym): reuse, a connection the
server closed while it waited, and a cancelled exchange closing its connection. Real loopback
sockets on the real clock."""

from __future__ import annotations

from functools import partial

import h11
import pytest
import trio

from trio_gym.http import ConnectionPool, Endpoint, HttpLimits

HANG_GUARD_S = 30  # only a guard against a hang


class KeepAliveServer:
    """An HTTP/1.1 server that answers each request ``ok`` on the connection it came on, and
    counts connections; ``close_after_each`` closes every connection after its answer, as a
    server whose keep-alive timer expired. ``/stall`` is never answered: the server waits for
    its caller to leave, and says so in ``caller_left``."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0
        self.caller_left = trio.Event()
        self.close_after_each = False

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    self.requests += 1
                    if event.target == b"/stall":
                        while await stream.receive_some(65536):
                            pass
                        self.caller_left.set()
                        return
                if isinstance(event, h11.EndOfMessage):
                    await stream.send_all(
                        conn.send(h11.Response(status_code=200, headers=[("content-length", "2")]))
                        + conn.send(h11.Data(data=b"ok"))
                        + conn.send(h11.EndOfMessage())
                    )
                    if self.close_after_each:
                        return
                    conn.start_next_cycle()


async def _serving(nursery: trio.Nursery, server: KeepAliveServer) -> Endpoint:
    listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return Endpoint.parse(f"http://127.0.0.1:{port}")


async def _ok(pool: ConnectionPool, path: str = "/run") -> bytes:
    response = await pool.exchange("POST", path, b"{}", max_response_bytes=100, idle_timeout_s=10)
    return response.body


async def test_requests_one_after_another_share_one_connection() -> None:
    server = KeepAliveServer()
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            pool = ConnectionPool(await _serving(nursery, server), HttpLimits(), max_idle=4)
            assert [await _ok(pool) for _ in range(5)] == [b"ok"] * 5
            assert pool.waiting == 1
            await pool.aclose()
            nursery.cancel_scope.cancel()
    assert (server.requests, server.connections, pool.opened) == (5, 1, 1)


async def test_a_connection_the_server_closed_while_it_waited_is_not_used() -> None:
    server = KeepAliveServer()
    server.close_after_each = True  # every idle connection is closed by the server
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            pool = ConnectionPool(await _serving(nursery, server), HttpLimits(), max_idle=4)
            assert await _ok(pool) == b"ok"
            await trio.sleep(0.1)  # the server's close has arrived
            assert await _ok(pool) == b"ok"  # on a fresh connection, nothing failed
            await pool.aclose()
            nursery.cancel_scope.cancel()
    assert (server.requests, server.connections, pool.opened) == (2, 2, 2)


async def test_a_connection_waits_no_longer_than_its_idle_time() -> None:
    server = KeepAliveServer()
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            endpoint = await _serving(nursery, server)
            pool = ConnectionPool(endpoint, HttpLimits(), max_idle=4, idle_s=0.05)
            await _ok(pool)
            await trio.sleep(0.1)  # longer than idle_s: the server may be about to close it
            await _ok(pool)
            await pool.aclose()
            nursery.cancel_scope.cancel()
    assert pool.opened == 2


async def test_a_cancelled_exchange_closes_its_connection_and_the_next_gets_a_fresh_one() -> None:
    server = KeepAliveServer()
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            pool = ConnectionPool(await _serving(nursery, server), HttpLimits(), max_idle=4)
            await _ok(pool)
            with trio.move_on_after(0.2):  # the example is cancelled while its server works
                await _ok(pool, "/stall")
            await server.caller_left.wait()  # the server sees its caller leave
            assert await _ok(pool) == b"ok"
            await pool.aclose()
            nursery.cancel_scope.cancel()
    assert (server.requests, pool.opened) == (3, 2)


@pytest.mark.parametrize("max_idle", [1])
async def test_no_more_connections_wait_than_max_idle(max_idle: int) -> None:
    server = KeepAliveServer()
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            pool = ConnectionPool(await _serving(nursery, server), HttpLimits(), max_idle=max_idle)
            async with trio.open_nursery() as rows:
                for _ in range(3):
                    rows.start_soon(_ok, pool)
            assert (pool.opened, pool.waiting) == (3, max_idle)
            await _ok(pool)
            await _ok(pool)
            await pool.aclose()
            nursery.cancel_scope.cancel()
    assert pool.opened == 3  # one kept of the three; it carried the next two
