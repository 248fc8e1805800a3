"""Test doubles and wire helpers. Runners here are real runners with counters, not stubs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import pydantic
import trio
import trio.testing

from trio_gym.config import ServeConfig
from trio_gym.host import Host, handle_connection, serve
from trio_gym.runners import ExampleContext, ExampleRunner, Runner


class CountingRunner:
    """Wraps a runner and records, with trio times, how every example started and ended."""

    def __init__(self, inner: Runner | None = None) -> None:
        self.inner = inner or ExampleRunner()
        self.started: list[tuple[int, float]] = []
        self.completed: list[tuple[int, float]] = []
        self.cancelled: list[tuple[int, float]] = []
        self.failed: list[tuple[int, float]] = []
        self.running = 0
        self.peak = 0
        self._changed = trio.Event()

    def __getattr__(self, name: str) -> Any:
        # Whatever else the wrapped runner offers (checkpoint participation, start) shows through.
        return getattr(self.inner, name)

    def check_example(self, example: Mapping[str, Any]) -> None:
        self.inner.check_example(example)

    def _note(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        self.started.append((context.index, trio.current_time()))
        self.running += 1
        self.peak = max(self.peak, self.running)
        self._note()
        ended = self.cancelled  # unless it returns or raises: a group of Cancelled counts too
        try:
            result = await self.inner.run_example(example, context)
            ended = self.completed
        except Exception:
            ended = self.failed
            raise
        finally:
            ended.append((context.index, trio.current_time()))
            self.running -= 1
            self._note()
        return result

    async def wait_for(self, predicate: Callable[[CountingRunner], bool]) -> None:
        """Sleep until ``predicate(self)`` holds, waking on every start and end."""
        while not predicate(self):
            await self._changed.wait()


class ScriptedRunner:
    """Each example says what to do: ``{"sleep_s": s, "result": r, "raise": "message"}``."""

    def check_example(self, example: Mapping[str, Any]) -> None:
        unknown = (
            set(example)
            - {"sleep_s", "result", "raise"}
            - {key for key in example if key.startswith("_")}
        )
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        await trio.sleep(example.get("sleep_s", 0))
        if "raise" in example:
            raise RuntimeError(example["raise"])
        return example.get("result", {"index": context.index})


def request_bytes(
    body: bytes | Mapping[str, Any] = b"",
    *,
    method: str = "POST",
    target: str = "/rollouts/run",
    version: str = "1.1",
    headers: Sequence[tuple[str, str]] = (),
    content_length: bool = True,
) -> bytes:
    """A raw request, as a test wants it (malformed on purpose if asked)."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    lines = [f"{method} {target} HTTP/{version}", "Host: test"]
    if content_length and (body or method == "POST"):
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@attrs.define
class Reply:
    """A response as it arrived: head, each body piece with its arrival time, framing."""

    status: int = 0
    headers: dict[str, str] = attrs.field(factory=dict)
    head_at: float = 0.0
    pieces: list[tuple[float, bytes]] = attrs.field(factory=list)
    complete: bool = False
    ended_at: float = 0.0

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.pieces)

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def framing(self) -> str:
        if "content-length" in self.headers:
            return "content-length"
        if self.headers.get("transfer-encoding") == "chunked":
            return "chunked"
        return "close-delimited"

    @property
    def heartbeat_times(self) -> list[float]:
        return [at for at, data in self.pieces if data == b" "]


async def read_reply(stream: trio.abc.ReceiveStream, *, method: bytes = b"POST") -> Reply:
    """Parse one response from ``stream`` with h11, recording when each piece arrived."""
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method=method, target="/", headers=[("host", "test")]))
    parser.send(h11.EndOfMessage())
    reply = Reply()
    while True:
        try:
            event = parser.next_event()
        except h11.RemoteProtocolError:
            if reply.status:
                raise
            return reply  # closed without a response: status 0, not complete
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                data = b""
            parser.receive_data(data)
            continue
        now = trio.current_time()
        if isinstance(event, h11.Response):
            reply.status = event.status_code
            reply.headers = {name.decode(): value.decode() for name, value in event.headers}
            reply.head_at = now
        elif isinstance(event, h11.Data):
            reply.pieces.append((now, bytes(event.data)))
        elif isinstance(event, h11.EndOfMessage):
            reply.complete = True
            reply.ended_at = now
            return reply
        elif isinstance(event, h11.ConnectionClosed):
            reply.ended_at = now
            return reply


async def exchange(
    stream: trio.abc.Stream, request: bytes, *, half_close: bool = False, method: bytes = b"POST"
) -> Reply:
    await stream.send_all(request)
    if half_close:
        assert isinstance(stream, trio.abc.HalfCloseableStream)
        await stream.send_eof()
    return await read_reply(stream, method=method)


def control_fields(directory: str, lease_s: float) -> dict[str, dict[str, Any]]:
    """Every POST operation of the control plane (by name), with the fields besides its id
    and deadline of a body the host would carry out: a test that sends each fails here when
    an operation is added."""
    return {
        "prepare": {"lease_s": lease_s},
        "renew": {"lease_s": lease_s},
        "commit": {"directory": directory},
        "resume": {},
        "restore": {"directory": directory},
        "retire": {"rollouts": []},
        "forget": {},
    }


@attrs.frozen
class RawAnswer:
    """An answer read to the connection's end: its bytes as they came, and as h11 reads them."""

    raw: bytes
    status: int
    headers: list[str]
    body: bytes


async def raw_answer(port: int, request: bytes, method: str) -> RawAnswer:
    """``request`` on a TCP connection of its own, and everything the host sent back."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    raw = b""
    async with stream:
        await stream.send_all(request)
        with trio.fail_after(20):
            while data := await stream.receive_some(65536):
                raw += data
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
    parser.send(h11.EndOfMessage())
    parser.receive_data(raw)
    parser.receive_data(b"")
    status, headers, body = 0, [], b""
    while (event := parser.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        if isinstance(event, h11.Response):
            status = event.status_code
            headers = [name.decode() for name, _ in event.headers]
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            break
    return RawAnswer(raw, status, headers, body)


@asynccontextmanager
async def running_host(
    config: ServeConfig | None = None, *, runner: Runner | None = None, **overrides: Any
) -> AsyncIterator[tuple[Host, int]]:
    """A real host on a loopback port; shut down (gracefully) on exit."""
    config = config or ServeConfig(port=0, **overrides)
    host = Host(config, runner=runner)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve, host)
        try:
            yield host, port
        finally:
            host.lifecycle.request_shutdown()


async def tcp_exchange(port: int, request: bytes, **kwargs: Any) -> Reply:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        return await exchange(stream, request, **kwargs)


URL = "http://sandbox.invalid:8080"


def in_memory(nursery: trio.Nursery, host: Host) -> Any:
    """An opener that connects the client to ``host`` over memory streams (virtual time)."""

    async def open_stream(endpoint: Any) -> trio.abc.Stream:
        client, server = trio.testing.memory_stream_pair()
        nursery.start_soon(handle_connection, host, server)
        return client

    return open_stream


def wire(reply: pydantic.BaseModel) -> Any:
    """A control reply as the JSON document it travelled as (what these tests read)."""
    return reply.model_dump(mode="json")


@attrs.define
class WrittenFromAWorker:
    """A file-writing function wrapped to ask the trio thread for its time before it writes
    (``trio.from_thread``): only a worker thread can ask, and only a trio thread that runs on
    answers. ``answered`` holds a time per write."""

    write: Callable[..., Any]
    answered: list[float] = attrs.field(factory=list)

    def __call__(self, *args: Any) -> Any:
        self.answered.append(trio.from_thread.run_sync(trio.current_time))
        return self.write(*args)
