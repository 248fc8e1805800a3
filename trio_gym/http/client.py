"""The client half: one request and its response on a connection of its own.

Bodies are read with :func:`trio_gym.http.messages.read_body`, the same reader the host uses,
so there is one parser for both directions. Failures come in two kinds that callers must tell
apart, because only the first may be retried without running anything twice:

- :class:`NoResponse`: no response head arrived (refused, reset, closed without a word);
  :class:`ConnectFailed`, its narrower kind, says the request never left at all;
- :class:`BodyFailed`: the head arrived, then the body did not (cut short, too large, stalled).
"""

from __future__ import annotations

import errno
import ipaddress
import math
import socket
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Final

import attrs
import trio

from trio_gym.errors import WireError, without_userinfo
from trio_gym.http.connection import HttpConnection
from trio_gym.http.h11_build import h11
from trio_gym.http.limits import HttpLimits
from trio_gym.http.messages import read_body, send_message, travels_in_a_header
from trio_gym.http.transport import ConnectionLost, transport_of

# A request body up to this size is sent before the answer is read, not beside it.
SMALL_UPLOAD_BYTES: Final = 64 * 1024
# How long a kept-alive connection may wait for its next request (see ConnectionPool).
POOL_IDLE_S: Final = 2.0


@attrs.frozen
class Endpoint:
    """Where an ``http://`` URL points: host, port, and the base path requests are joined to."""

    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        """Parse ``http://host[:port][/base]``; raises ``ValueError`` naming what is wrong (the
        URL quoted without its user information: a credential has no place in a message)."""
        shown = repr(without_userinfo(url))
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{shown}: not a URL ({without_userinfo(str(exc))})") from exc
        if parts.scheme != "http":
            raise ValueError(f"{shown}: only http:// URLs are supported (got {parts.scheme!r})")
        if not parts.hostname:
            raise ValueError(f"{shown}: the URL names no host")
        if parts.query or parts.fragment:
            raise ValueError(f"{shown}: a base URL takes no query or fragment")
        if any(character.isspace() or ord(character) < 32 for character in parts.path):
            raise ValueError(f"{shown}: the path has whitespace or control characters")
        return cls(parts.hostname, port or 80, parts.path.rstrip("/"))

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def target(self, path: str) -> str:
        return f"{self.base_path}{path}"


StreamOpener = Callable[[Endpoint], Awaitable[trio.abc.Stream]]


async def open_tcp(endpoint: Endpoint) -> trio.abc.Stream:
    """The default opener: a TCP connection to the endpoint.

    An address (a Gym server's ``127.0.0.1``, say) is connected to directly: there is nothing
    to resolve and no second address to race, and ``trio.open_tcp_stream``'s nursery and task
    per attempt cost a host running thousands of examples more than the exchange itself.
    """
    try:
        family = (
            socket.AF_INET6 if ipaddress.ip_address(endpoint.host).version == 6 else socket.AF_INET
        )
    except ValueError:
        return await trio.open_tcp_stream(endpoint.host, endpoint.port)
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    connected = False
    try:
        await sock.connect((endpoint.host, endpoint.port))
        connected = True
    finally:
        if not connected:  # refused, or cancelled while connecting: no descriptor left open
            sock.close()
    return trio.SocketStream(sock)


class NoResponse(Exception):
    """No response head arrived; the message says what happened instead."""


class ConnectFailed(NoResponse):
    """Not even a connection: the request certainly never reached the peer. ``refused``: the
    peer's address answered that nothing listens there (the process is gone or restarted)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class BodyFailed(Exception):
    """The response head arrived (``status``) but its body did not complete.

    ``too_large`` says the body was refused for exceeding the reader's limit rather than cut.
    """

    def __init__(self, message: str, *, status: int, too_large: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.too_large = too_large


@attrs.frozen
class Response:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)


class ClientExchange:
    """One request and its response on a connection of its own; an async context manager.

    ``async with await ClientExchange.open(...) as exchange:`` — ``open`` connects and is
    awaited first (``NoResponse`` if it cannot), then the block owns the connection;
    :meth:`send` uploads the request and returns the response head, :meth:`read_body` or
    :meth:`next_data` read the body. Leaving the block closes the connection at once, which a
    peer serving the request sees as the caller leaving.
    """

    def __init__(self, conn: HttpConnection, endpoint: Endpoint) -> None:
        self.conn = conn
        self.endpoint = endpoint

    @classmethod
    async def open(
        cls,
        endpoint: Endpoint,
        limits: HttpLimits,
        *,
        opener: StreamOpener = open_tcp,
        request_version: bytes = b"1.1",
        connect_timeout_s: float = math.inf,
    ) -> ClientExchange:
        with trio.move_on_after(connect_timeout_s):
            try:
                stream = await opener(endpoint)
            except OSError as exc:
                refused = exc.errno == errno.ECONNREFUSED
                raise ConnectFailed(
                    f"could not connect to {endpoint.authority}: {exc}", refused=refused
                ) from exc
            transport = transport_of(stream, send_timeout_s=limits.send_timeout_s)
            conn = HttpConnection(transport, h11.CLIENT, limits, request_version=request_version)
            return cls(conn, endpoint)
        raise ConnectFailed(
            f"could not connect to {endpoint.authority} within {connect_timeout_s:g} s"
        )

    async def __aenter__(self) -> ClientExchange:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.conn.aclose()

    async def send(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        headers: Sequence[tuple[str, str]] = (),
        head_timeout_s: float = math.inf,
        keep_alive: bool = False,
    ) -> h11.Response:
        """Upload the request while watching for the answer; return the final response head.

        A server may answer before the upload ends (a 413 decided from the declared length) and
        then stop reading; an upload that waited to finish before reading would die on a broken
        pipe and never see the answer. So the head is awaited beside the upload, and an early
        head ends the upload. Once the upload has ended, the head has ``head_timeout_s`` to
        come (an upload's own time is not counted: a big one may take long). Raises
        :class:`NoResponse`.
        """
        # A malformed request (a bug) raises here, before anything is sent.
        request = build_request(self.endpoint, method, path, body, headers, keep_alive=keep_alive)
        upload_failed: ConnectionLost | None = None
        head_wait = trio.CancelScope()

        async def upload() -> None:
            nonlocal upload_failed
            try:
                await send_message(self.conn, request, body)
            except ConnectionLost as exc:
                upload_failed = exc  # the answer may still be readable; the head decides
            head_wait.deadline = trio.current_time() + head_timeout_s

        failure: Exception | None = None
        head: h11.Response | None = None
        if len(body) <= SMALL_UPLOAD_BYTES:
            # Taken by the kernel's buffer at once: no early answer can be missed while it
            # goes, and a task to watch for one would cost more than the exchange.
            await upload()
            with head_wait:
                head, failure = await _response_head(self.conn)
        else:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(upload)
                with head_wait:
                    head, failure = await _response_head(self.conn)
                nursery.cancel_scope.cancel()
        if head_wait.cancelled_caught:
            raise NoResponse(
                f"no response head from {self.endpoint.authority} within {head_timeout_s:g} s "
                "of the request's end (head_timeout_s)"
            )
        if head is None:
            cause = failure if upload_failed is None else f"{upload_failed}; then {failure}"
            raise NoResponse(f"no response from {self.endpoint.authority}: {cause}") from failure
        return head

    async def read_body(
        self,
        head: h11.Response,
        *,
        max_bytes: int,
        idle_timeout_s: float,
        on_data: Callable[[bytes], None] | None = None,
    ) -> bytes:
        """The whole body; raises :class:`BodyFailed`."""
        try:
            return await read_body(
                self.conn, head, max_bytes=max_bytes, idle_timeout_s=idle_timeout_s, on_data=on_data
            )
        except WireError as exc:
            too_large = exc.status == 413
            raise BodyFailed(exc.message, status=head.status_code, too_large=too_large) from exc
        except ConnectionLost as exc:
            raise BodyFailed(str(exc), status=head.status_code) from exc

    async def next_data(self, head: h11.Response, *, idle_timeout_s: float) -> bytes | None:
        """The next piece of the body as it arrives, or ``None`` once it is complete.

        Raises :class:`BodyFailed` if the body is cut short or nothing arrives for
        ``idle_timeout_s``.
        """
        try:
            event = await self.conn.next_event(idle_timeout_s)
        except (ConnectionLost, h11.RemoteProtocolError) as exc:
            raise BodyFailed(f"the body was cut short: {exc}", status=head.status_code) from exc
        if event is None:
            raise BodyFailed(
                f"no byte of the body arrived for {idle_timeout_s:g} s", status=head.status_code
            )
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            return None
        raise BodyFailed(f"the body ended early ({event!r})", status=head.status_code)


async def exchange(
    endpoint: Endpoint,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    limits: HttpLimits,
    max_response_bytes: int,
    idle_timeout_s: float,
    headers: Sequence[tuple[str, str]] = (),
    opener: StreamOpener = open_tcp,
    request_version: bytes = b"1.1",
    on_head: Callable[[h11.Response], None] | None = None,
    on_data: Callable[[bytes], None] | None = None,
    connect_timeout_s: float = math.inf,
    head_timeout_s: float = math.inf,
) -> Response:
    """One whole request and response; raises :class:`NoResponse` or :class:`BodyFailed`."""
    opened = await ClientExchange.open(
        endpoint,
        limits,
        opener=opener,
        request_version=request_version,
        connect_timeout_s=connect_timeout_s,
    )
    async with opened:
        head = await opened.send(method, path, body, headers=headers, head_timeout_s=head_timeout_s)
        if on_head is not None:
            on_head(head)
        data = await opened.read_body(
            head, max_bytes=max_response_bytes, idle_timeout_s=idle_timeout_s, on_data=on_data
        )
    return Response(head.status_code, tuple(head.headers), data)


def build_request(
    endpoint: Endpoint,
    method: str,
    path: str,
    body: bytes,
    headers: Sequence[tuple[str, str]] = (),
    *,
    keep_alive: bool = False,
) -> h11.Request:
    """A request framed by ``Content-Length`` (``0`` included) that closes the connection,
    unless ``keep_alive``.

    Raises ``ValueError`` for a header value HTTP cannot carry — naming the header, never the
    value (it is often a secret: an identity, a token read from a file with Windows line
    endings) — and ``h11.LocalProtocolError`` for any other request HTTP cannot carry (a bug in
    the caller).
    """
    for name, value in headers:
        if not travels_in_a_header(value):
            raise ValueError(
                f"the {name} header's value is not visible ASCII with no space at either end "
                "(a CR from a file with Windows line endings?); its value is not shown"
            )
    framing = [("host", endpoint.authority), ("content-length", str(len(body)))]
    if not keep_alive:
        framing.append(("connection", "close"))
    return h11.Request(method=method, target=endpoint.target(path), headers=[*framing, *headers])


class ConnectionPool:
    """Connections kept alive toward one server, each carrying one request at a time.

    A connection goes back to the pool only after an exchange that ended whole (its response
    read to the end, neither side asking to close); a failed or cancelled exchange closes its
    connection, which is how a server learns that its caller left. At most ``max_idle`` wait
    between requests, each for ``idle_s`` at most — less than servers keep an idle connection
    (uvicorn, under Gym, 5 s), so the server's close rarely races our next request. A waiting
    connection the server closed (or wrote to) is dropped before anything is sent on it, and the
    request goes on the next one, or a fresh one.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        limits: HttpLimits,
        *,
        max_idle: int,
        opener: StreamOpener = open_tcp,
        idle_s: float = POOL_IDLE_S,
    ) -> None:
        self.endpoint = endpoint
        self._limits = limits
        self._max_idle = max_idle
        self._opener = opener
        self._idle_s = idle_s
        self._idle: list[tuple[float, HttpConnection]] = []
        self.opened = 0
        """Connections this pool has opened (the rest of its requests reused one)."""

    @property
    def waiting(self) -> int:
        """How many connections wait for a request."""
        return len(self._idle)

    async def exchange(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        max_response_bytes: int,
        idle_timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
        connect_timeout_s: float = math.inf,
    ) -> Response:
        """One whole request and response, as :func:`exchange`; raises :class:`NoResponse` or
        :class:`BodyFailed`."""
        conn = await self._take_idle()
        if conn is None:
            opened = await ClientExchange.open(
                self.endpoint,
                self._limits,
                opener=self._opener,
                connect_timeout_s=connect_timeout_s,
            )
            self.opened += 1
        else:
            opened = ClientExchange(conn, self.endpoint)
        kept = False
        try:
            head = await opened.send(method, path, body, headers=headers, keep_alive=True)
            data = await opened.read_body(
                head, max_bytes=max_response_bytes, idle_timeout_s=idle_timeout_s
            )
            kept = len(self._idle) < self._max_idle and opened.conn.start_next_request()
        finally:
            if kept:
                self._idle.append((trio.current_time(), opened.conn))
            else:
                await opened.conn.aclose()
        return Response(head.status_code, tuple(head.headers), data)

    async def _take_idle(self) -> HttpConnection | None:
        """The most recently used waiting connection that is still usable, closing the others
        found unusable on the way. A checkpoint."""
        now = trio.current_time()
        while self._idle:
            since, conn = self._idle.pop()
            if now - since < self._idle_s and conn.idle_and_open():
                await trio.lowlevel.checkpoint()
                return conn
            await conn.aclose()
        await trio.lowlevel.checkpoint()
        return None

    async def aclose(self) -> None:
        """Close every waiting connection (the pool's owner is done with the server)."""
        idle, self._idle = self._idle, []
        for _, conn in idle:
            await conn.aclose()


async def _response_head(conn: HttpConnection) -> tuple[h11.Response | None, Exception | None]:
    """The response head, or what stood in for it."""
    try:
        return await read_response_head(conn), None
    except (ConnectionLost, EOFError, h11.RemoteProtocolError) as exc:
        return None, exc


async def read_response_head(conn: HttpConnection) -> h11.Response:
    """Read the final response head, skipping ``1xx`` interim responses.

    No deadline of its own: the caller bounds the whole exchange. Raises
    ``h11.RemoteProtocolError`` for a head that is not HTTP, ``ConnectionLost`` on a reset, and
    ``EOFError`` if the peer closed before answering.
    """
    while True:
        try:
            event = await conn.next_event()
        except h11.RemoteProtocolError:
            if conn.eof_received:  # h11's words for it are about its own states
                raise EOFError("the peer closed the connection without answering") from None
            raise
        if isinstance(event, h11.Response):
            return event
        if isinstance(event, h11.ConnectionClosed):
            raise EOFError("the peer closed the connection without answering")  # noqa: TRY004
        # An interim answer (100 Continue); the final one follows.
