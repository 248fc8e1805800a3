"""A TCP proxy in front of a host that can swallow the replies to chosen control operations.

Everything is forwarded byte for byte. For a request whose path ends with one of the names in
``swallow`` (``prepare``, ``renew``...), the request still reaches the host but its reply never
comes back: the caller sees a host that acted and never answered, as behind a hung proxy.
"""

from __future__ import annotations

import trio


class StallingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.swallow: set[str] = set()
        self.swallowed: list[str] = []
        """Operations whose reply was swallowed, in order."""
        self.abandoned = 0
        """Swallowed calls whose caller gave up and closed the connection."""

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        async with client:
            head = b""
            while b"\r\n\r\n" not in head:
                data = await client.receive_some()
                if not data:
                    return
                head += data
            path = head.split(b" ", 2)[1].decode()
            operation = path.rsplit("/", 1)[-1]
            try:
                upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
            except OSError:
                return  # the host is gone: the caller sees the connection close
            async with upstream:
                try:
                    await upstream.send_all(head)
                except trio.BrokenResourceError:
                    return  # it died as the request went on (a test that kills it): the same
                if operation in self.swallow:
                    self.swallowed.append(operation)
                    await self._swallow(client, upstream)
                    return
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_pump, client, upstream, nursery.cancel_scope)
                    nursery.start_soon(_pump, upstream, client, nursery.cancel_scope)

    async def _swallow(self, client: trio.SocketStream, upstream: trio.SocketStream) -> None:
        """Send the rest of the request on, read the reply and drop it, hold the caller."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, client, upstream, nursery.cancel_scope)
            nursery.start_soon(_drain, upstream)
        self.abandoned += 1


async def _pump(source: trio.SocketStream, sink: trio.SocketStream, done: trio.CancelScope) -> None:
    try:
        while data := await source.receive_some():
            await sink.send_all(data)
    except trio.BrokenResourceError:
        pass
    done.cancel()


async def _drain(source: trio.SocketStream) -> None:
    try:
        while await source.receive_some():
            pass
    except trio.BrokenResourceError:
        pass
    await trio.sleep_forever()  # the reply is gone; the caller waits until it gives up
