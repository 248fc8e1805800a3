"""A reverse proxy that behaves like the sandbox proxy of the seed bug.

It forwards a request to the upstream host byte for byte and streams the response back, and it
ends the response *as soon as the response's framing says it is complete* — it never waits for
the upstream connection to close. A body framed by ``Content-Length`` or chunked coding is
complete at its declared end. A body with no framing at all (delimited only by the close) is
taken as complete at the first piece of it that arrives, which is exactly how a lone heartbeat
space became a whole ``200`` answer in production.
"""

from __future__ import annotations

import h11
import trio


class FramingProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.framings: list[str] = []
        """The framing of every response forwarded: content-length, chunked or close-delimited."""

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
        async with upstream:
            method = await self._forward_request(client, upstream)
            await self._forward_response(upstream, client, method)

    async def _forward_request(
        self, client: trio.SocketStream, upstream: trio.SocketStream
    ) -> bytes:
        parser = h11.Connection(h11.SERVER)
        method = b"GET"
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                data = await client.receive_some(65536)
                parser.receive_data(data)
                await upstream.send_all(data)
                if not data:
                    return method
            elif isinstance(event, h11.Request):
                method = event.method
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return method

    async def _forward_response(
        self, upstream: trio.SocketStream, client: trio.SocketStream, method: bytes
    ) -> None:
        parser = h11.Connection(h11.CLIENT)
        parser.send(h11.Request(method=method, target="/", headers=[("host", "proxy")]))
        parser.send(h11.EndOfMessage())
        framing = ""
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                data = await upstream.receive_some(65536)
                parser.receive_data(data)
                if data:
                    await client.send_all(data)
                continue
            if isinstance(event, h11.Response):
                framing = _framing(event)
                self.framings.append(framing)
            elif isinstance(event, h11.Data) and framing == "close-delimited":
                return  # "the body so far" is taken as the whole answer
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return


def _framing(response: h11.Response) -> str:
    names = {name for name, _ in response.headers}
    if b"content-length" in names:
        return "content-length"
    if b"transfer-encoding" in names:
        return "chunked"
    return "close-delimited"
