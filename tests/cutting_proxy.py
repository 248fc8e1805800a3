"""A TCP proxy that ends chosen answers early and *cleanly*, as a proxy's idle cut or restart
does: after a number of body chunks it writes the zero-length chunk (a whole-looking chunked
body) and closes both sides. Everything else is forwarded byte for byte.

The ``n``-th ``POST /rollouts/run`` (counted from 0) is cut when ``n`` is in ``cut``, after
``after_chunks`` chunks of its body.
"""

from __future__ import annotations

import trio


class CuttingProxy:
    def __init__(self, upstream_port: int, *, cut: set[int], after_chunks: int) -> None:
        self.upstream_port = upstream_port
        self.cut, self.after_chunks = cut, after_chunks
        self.posts = 0
        self.cuts_made = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        async with client, await trio.open_tcp_stream("127.0.0.1", self.upstream_port) as upstream:
            first = await client.receive_some(65536)
            cutting = False
            if first.startswith(b"POST /rollouts/run"):
                cutting = self.posts in self.cut
                self.posts += 1
            await upstream.send_all(first)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, client, upstream)
                if cutting:
                    await self._cut_answer(upstream, client)
                    self.cuts_made += 1
                else:
                    await _pump(upstream, client)
                nursery.cancel_scope.cancel()

    async def _cut_answer(self, upstream: trio.SocketStream, client: trio.SocketStream) -> None:
        """Forward the head and ``after_chunks`` whole chunks, then end the body cleanly."""
        buffer = bytearray()
        while b"\r\n\r\n" not in buffer:
            buffer += await _more(upstream)
        end = buffer.index(b"\r\n\r\n") + 4
        await client.send_all(bytes(buffer[:end]))
        del buffer[:end]
        for _ in range(self.after_chunks):
            while b"\r\n" not in buffer:
                buffer += await _more(upstream)
            line_end = buffer.index(b"\r\n")
            size = int(bytes(buffer[:line_end]).split(b";")[0], 16)
            whole = line_end + 2 + size + 2
            while len(buffer) < whole:
                buffer += await _more(upstream)
            await client.send_all(bytes(buffer[:whole]))
            del buffer[:whole]
        await client.send_all(b"0\r\n\r\n")


async def _more(stream: trio.SocketStream) -> bytes:
    data = await stream.receive_some(65536)
    if not data:
        raise trio.BrokenResourceError("the upstream closed")
    return data


async def _pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
