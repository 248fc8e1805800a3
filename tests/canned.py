"""Hosts that answer with whatever a test scripts, for the client's classification rules.

Each connection takes the next behaviour from a list; the last one repeats. A behaviour reads
the whole request first (so "requests received" counts only requests that arrived), then does
its thing on the raw stream.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import h11
import trio
import trio.testing

from trio_gym.http import Endpoint

Behaviour = Callable[[trio.abc.Stream], Awaitable[None]]


async def read_request(stream: trio.abc.Stream) -> bytes:
    parser = h11.Connection(h11.SERVER)
    body = b""
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return body
        elif isinstance(event, h11.ConnectionClosed):
            raise EOFError("the client closed before sending a whole request")


def respond(raw: bytes) -> Behaviour:
    async def behaviour(stream: trio.abc.Stream) -> None:
        await stream.send_all(raw)
        await stream.aclose()

    return behaviour


def json_response(status: int, body: bytes, *, reason: str = "X") -> bytes:
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


def chunked_response(*chunks: bytes, end: bool = True) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    body = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks)
    return head + body + (b"0\r\n\r\n" if end else b"")


async def hang_up(stream: trio.abc.Stream) -> None:
    """Read the request, then close without a word (no response headers at all)."""
    await stream.aclose()


class CannedHost:
    """An opener for :class:`RolloutClient` whose connections follow the scripted behaviours.

    ``refuse`` as a behaviour makes the opener raise ``ConnectionRefusedError`` (the request
    never lands). ``requests`` counts requests that arrived whole.
    """

    REFUSE: Behaviour | None = None

    def __init__(self, nursery: trio.Nursery, behaviours: list[Behaviour | None]) -> None:
        self.nursery = nursery
        self.behaviours = behaviours
        self.connections = 0
        self.requests: list[bytes] = []
        self.opened_at: list[float] = []

    async def open(self, endpoint: Endpoint) -> trio.abc.Stream:
        behaviour = self.behaviours[min(self.connections, len(self.behaviours) - 1)]
        self.connections += 1
        self.opened_at.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if behaviour is None:
            raise ConnectionRefusedError(111, "Connection refused")
        client, server = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self._serve, server, behaviour)
        return client

    async def _serve(self, stream: trio.abc.Stream, behaviour: Behaviour) -> None:
        self.requests.append(await read_request(stream))
        await behaviour(stream)


async def stall(stream: trio.abc.Stream) -> None:
    """Read the request, then never answer and never close."""
    await trio.sleep_forever()
