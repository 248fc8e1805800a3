"""Reading and writing whole HTTP messages on an :class:`HttpConnection`.

The framing rule lives here and nowhere else: every response this project sends
is framed by ``Content-Length`` (``0`` included) or by chunked transfer coding ending in the
zero-length chunk, and says ``Connection: close``. A body delimited only by the connection
closing is never written — a proxy that does not wait for the close takes whatever it has as
the whole answer (the seed bug: a lone heartbeat space returned as a complete 200).

Four ways to send a response — :func:`send_empty`, :func:`send_body`, :func:`send_json`,
:class:`ChunkedBody` — and one way to read a body, :func:`read_body`, shared by the host
(request bodies) and the trainer client (response bodies).
"""

from __future__ import annotations

import ast
import functools
import http
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Final

import trio

from trio_gym.errors import ErrorCode, WireError, shown
from trio_gym.http.connection import HttpConnection
from trio_gym.http.h11_build import h11
from trio_gym.http.transport import ConnectionLost

Headers = Sequence[tuple[str, str]]

# A body is split into chunks (or Data events) of this size; HttpConnection writes them in
# bounded runs of HttpLimits.write_bytes. About 10 bytes of chunk header per 256 KiB.
BODY_PIECE_BYTES: Final = 256 * 1024

SUPPORTED_VERSIONS: Final = (b"1.0", b"1.1")


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def _response(status: int, headers: Headers) -> h11.Response:
    return h11.Response(
        status_code=status,
        reason=_reason(status),
        headers=[*headers, ("connection", "close")],
    )


@functools.lru_cache(maxsize=64)
def _chunked_head(status: int, content_type: str, headers: Headers) -> h11.Response:
    """The head of a chunked answer, validated by h11 once and reused: h11's events are
    immutable, and checking the same few headers again for every answer was an eighth of a
    short batch's cost."""
    return _response(
        status, [("content-type", content_type), ("transfer-encoding", "chunked"), *headers]
    )


async def send_body(
    conn: HttpConnection,
    status: int,
    body: bytes,
    *,
    content_type: str,
    headers: Headers = (),
) -> None:
    """Send a whole response behind ``Content-Length``.

    To a ``HEAD`` request no body follows: the headers say what a ``GET`` would get, or, when
    h11 refused the request's head (so that h11 cannot know it was HEAD and would expect the
    body its ``Content-Length`` announced), ``Content-Length: 0``. Raises
    :class:`ConnectionLost` if the peer is gone; a checkpoint.
    """
    if conn.answering_head:
        length = str(len(body)) if conn.request_method == b"HEAD" else "0"
        head = _response(
            status, [("content-type", content_type), ("content-length", length), *headers]
        )
        await conn.send(head, h11.EndOfMessage())
        return
    head = _response(
        status,
        [("content-type", content_type), ("content-length", str(len(body))), *headers],
    )
    await send_message(conn, head, body)


async def send_message(conn: HttpConnection, head: h11.Request | h11.Response, body: bytes) -> None:
    """Send a head and its body (framed by the head's Content-Length), as one whole write."""
    await conn.send(head, *_data_events(body), h11.EndOfMessage())


async def send_empty(conn: HttpConnection, status: int, *, headers: Headers = ()) -> None:
    """Send a response with no body, framed by ``Content-Length: 0``.

    Without it h11 would frame an HTTP/1.1 answer as chunked and an HTTP/1.0 answer by closing
    the connection — the one framing this project never sends.
    """
    await conn.send(_response(status, [("content-length", "0"), *headers]), h11.EndOfMessage())


_COMPACT: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def encode_json(document: Any) -> bytes:
    """Compact UTF-8 JSON; ``NaN`` and infinities are refused (they are not JSON)."""
    return _COMPACT.encode(document).encode("utf-8")


async def send_json(
    conn: HttpConnection, status: int, document: Any, *, headers: Headers = ()
) -> None:
    """Send ``document`` as an ``application/json`` body behind ``Content-Length``."""
    await send_body(
        conn, status, encode_json(document), content_type="application/json", headers=headers
    )


class ChunkedBody:
    """A response whose body is written piece by piece under chunked transfer coding.

    Chunked coding exists only in HTTP/1.1, and h11 silently drops it for an HTTP/1.0 peer and
    writes the pieces raw, delimited by the close alone; so :meth:`start` refuses a 1.0 peer
    outright instead. The body ends with the zero-length chunk written by :meth:`finish`.
    """

    def __init__(self, conn: HttpConnection) -> None:
        self._conn = conn

    @classmethod
    async def start(
        cls, conn: HttpConnection, status: int, *, content_type: str, headers: Headers = ()
    ) -> ChunkedBody:
        """Send the status line and headers now; the body follows through the returned object.

        Raises ``RuntimeError`` for a peer that did not speak HTTP/1.1 (a bug in the caller),
        :class:`ConnectionLost` if the peer is gone.
        """
        if conn.their_http_version != b"1.1":
            raise RuntimeError("chunked framing needs an HTTP/1.1 peer; answer 1.0 with send_body")
        await conn.send(_chunked_head(status, content_type, tuple(headers)))
        return cls(conn)

    async def send(self, data: bytes) -> None:
        """Send ``data`` whole, as one or more chunks, with no other write in between (a row
        of a stream is never split by a heartbeat or another row). Empty data is refused: it
        would write nothing."""
        if not data:
            raise ValueError("an empty chunk cannot be sent; finish() ends the body")
        await self._conn.send(*_data_events(data))

    def send_nowait(self, data: bytes) -> bool:
        """Send ``data`` as a chunk now if it can be done without waiting (see
        :meth:`HttpConnection.send_nowait`); False if it was not sent."""
        if not data:
            raise ValueError("an empty chunk cannot be sent; finish() ends the body")
        return self._conn.send_nowait(*_data_events(data))

    async def finish(self, last: bytes = b"") -> None:
        """Write ``last`` (if any) and the zero-length chunk that tells every reader the body
        is complete, in one write: a short answer's document and its end go out together."""
        await self._conn.send(*_data_events(last), h11.EndOfMessage())


def _data_events(data: bytes) -> list[h11.Data]:
    """``data`` in pieces of at most ``BODY_PIECE_BYTES`` (none for no data)."""
    pieces = range(0, len(data), BODY_PIECE_BYTES)
    return [h11.Data(data=data[i : i + BODY_PIECE_BYTES]) for i in pieces]


def declared_length(head: h11.Request | h11.Response) -> int | None:
    """The ``Content-Length`` a head declares (h11 has already checked it), else ``None``.

    With ``Transfer-Encoding`` present the length is not declared: chunked coding wins.
    """
    lengths = [value for name, value in head.headers if name == b"content-length"]
    chunked = any(name == b"transfer-encoding" for name, _ in head.headers)
    return int(lengths[0]) if lengths and not chunked else None


# h11 quotes the bytes it refused ("illegal header line: bytearray(b'...')"): a header line
# holds a secret as often as not (an identity, a bearer token with a stray CR), so they are
# read back here to say what is wrong with them, and never shown.
_QUOTED_BYTES: Final = re.compile(
    r"(?P<what>[^:]*): (?:bytearray\()?(?P<bytes>b(?:'.*'|\".*\"))", re.S
)
_TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FORBIDDEN_IN_VALUES: Final = {0x0D: "a CR", 0x0A: "an LF", 0x00: "a NUL"}


def travels_in_a_header(value: str) -> bool:
    """Whether ``value`` arrives as it was sent in a header: visible ASCII and inner spaces
    only (h11 strips the ends of a value, refuses CR, LF and NUL, and a value read from a file
    with Windows line endings ends in a CR)."""
    return value.isascii() and value.isprintable() and value == value.strip()


def protocol_problem(exc: h11.ProtocolError) -> str:
    """What h11 found wrong with a peer's bytes, in words that never carry those bytes."""
    text = str(exc)
    quoted = _QUOTED_BYTES.match(text)
    if quoted is None:
        if "b'" in text or 'b"' in text:  # quoted in a way not read back here: not shown
            return "the bytes are not HTTP/1.x as h11 reads it (they are not shown)"
        return shown(text.encode(), 200)
    what = quoted["what"].strip()
    try:
        data = ast.literal_eval(quoted["bytes"])
    except (ValueError, SyntaxError):
        data = b""
    if what == "illegal header line" and isinstance(data, bytes):
        return _header_line_problem(data)
    if what == "illegal request line":
        return "the request line is not 'METHOD TARGET HTTP/1.x' in visible ASCII"
    if what == "illegal status line":
        return "the status line is not 'HTTP/1.x CODE REASON'"
    if what == "illegal chunk header":
        return "a chunk's size line is not a hexadecimal size"
    if what == "malformed chunk footer":
        return "a chunk does not end with CRLF where its size says it ends"
    return f"{shown(what.encode(), 100)} (the bytes are not shown)"


def _header_line_problem(line: bytes) -> str:
    """What is wrong with one header line: the header named when its name is a token, what is
    wrong with the value said, the value never shown."""
    name, colon, value = line.partition(b":")
    if not colon:
        return "a header line has no ':' between a name and a value (it is not shown)"
    if not _TOKEN.fullmatch(name):
        return (
            "a header line's name is not a token (letters, digits and !#$%&'*+-.^_`|~, with "
            "no space before the ':'); the line is not shown"
        )
    header = shown(name, 64)
    for byte in value:
        if byte in _FORBIDDEN_IN_VALUES or (byte < 0x20 and byte != 0x09):
            found = _FORBIDDEN_IN_VALUES.get(byte, f"the control byte \\x{byte:02x}")
            hint = " (read from a file with Windows line endings?)" if byte == 0x0D else ""
            return (
                f"the value of header {header} holds {found}, which a header value cannot "
                f"carry{hint}; its value is not shown"
            )
    return f"the value of header {header} is not a valid header value; its value is not shown"


def refusal_for(exc: h11.RemoteProtocolError) -> WireError:
    """The answer to bytes that are not HTTP or break a limit, from h11's status hint."""
    problem = protocol_problem(exc)
    if exc.error_status_hint == 431:
        return WireError(ErrorCode.HEADERS_TOO_LARGE, f"request head too large: {problem}")
    if exc.error_status_hint == 501:
        return WireError(ErrorCode.NOT_IMPLEMENTED, f"unsupported request framing: {problem}")
    return WireError(ErrorCode.INVALID_REQUEST, f"malformed HTTP request: {problem}")


async def read_request_head(conn: HttpConnection) -> h11.Request:
    """Read one request head within ``read_timeout_s`` of starting.

    Returns the request. Raises :class:`WireError` with what to answer (400 malformed, 408 too
    slow, 431 too large, 501 unsupported framing, 505 a version other than 1.0 and 1.1), or
    :class:`ConnectionLost` when the peer left before sending a request (nothing to answer).
    """
    timeout = conn.limits.read_timeout_s
    try:
        event = await conn.next_event(timeout)
    except h11.RemoteProtocolError as exc:
        raise refusal_for(exc) from exc
    if event is None:
        raise WireError(
            ErrorCode.REQUEST_TIMEOUT,
            f"the request head did not arrive within {timeout:g} s; send the whole request at once",
        )
    if isinstance(event, h11.ConnectionClosed):
        raise ConnectionLost("the peer closed the connection before sending a request")
    assert isinstance(event, h11.Request), event
    names = {name for name, _ in event.headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        # RFC 9112 §6.3: a request smuggling vector; refusing it is allowed and safest.
        raise WireError(
            ErrorCode.INVALID_REQUEST,
            "the request has both Content-Length and Transfer-Encoding; send one",
        )
    if event.http_version not in SUPPORTED_VERSIONS:
        raise WireError(
            ErrorCode.HTTP_VERSION_NOT_SUPPORTED,
            f"HTTP/{event.http_version.decode('ascii', 'replace')} is not supported; "
            "send HTTP/1.1 (or HTTP/1.0)",
        )
    return event


async def read_body(
    conn: HttpConnection,
    head: h11.Request | h11.Response,
    *,
    max_bytes: int,
    idle_timeout_s: float,
    min_rate: float | None = None,
    advice: str = "",
    on_data: Callable[[bytes], None] | None = None,
) -> bytes:
    """Read the body that follows ``head``, whole, however it is framed.

    A declared length over ``max_bytes`` is refused before a byte of the body is read; a
    chunked body is refused as soon as it grows past ``max_bytes``. ``Expect: 100-continue`` is
    answered only once the declared length is known to fit. ``on_data`` sees each piece as it
    arrives (progress, heartbeats).

    Time: no gap between bytes may exceed ``idle_timeout_s``; with ``min_rate`` (bytes per
    second) the whole body must also arrive within ``idle_timeout_s + received / min_rate``, so
    a peer trickling a byte at a time cannot hold the connection for hours.

    Raises :class:`WireError`: 413 too large (``advice`` appended), 408 too slow, 400 bad
    framing or a body cut short; :class:`ConnectionLost` on a reset. A body delimited by the
    close is read until the close: the caller decides whether that framing is acceptable.
    """
    declared = declared_length(head)
    if declared is not None and declared > max_bytes:
        raise _too_large(f"declares {declared} bytes", max_bytes, advice)
    if conn.peer_waits_for_100_continue:
        await conn.send(h11.InformationalResponse(status_code=100, headers=[]))
    body = bytearray()
    started = trio.current_time()
    while True:
        wait = idle_timeout_s
        if min_rate is not None:
            allowed = started + idle_timeout_s + len(body) / min_rate - trio.current_time()
            wait = min(wait, allowed)
        try:
            event = await conn.next_event(wait)
            if event is None:
                raise _too_slow(wait < idle_timeout_s, idle_timeout_s, min_rate, len(body))
        except h11.RemoteProtocolError as exc:
            raise WireError(
                ErrorCode.INVALID_REQUEST, f"malformed body: {protocol_problem(exc)}"
            ) from exc
        if isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_bytes:
                raise _too_large(f"grew past {max_bytes} bytes", max_bytes, advice)
            if on_data is not None:
                on_data(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return bytes(body)
        else:
            raise WireError(ErrorCode.INVALID_REQUEST, f"the body ended early ({event!r})")


def _too_slow(
    by_rate: bool, idle_timeout_s: float, min_rate: float | None, received: int
) -> WireError:
    if by_rate:
        reason = f"the body arrived slower than {min_rate:g} bytes/s"
    else:
        reason = f"no byte of the body arrived for {idle_timeout_s:g} s"
    return WireError(ErrorCode.REQUEST_TIMEOUT, f"{reason} ({received} bytes received)")


def _too_large(what: str, max_bytes: int, advice: str) -> WireError:
    message = f"the body {what}, over the limit of {max_bytes} bytes"
    return WireError(ErrorCode.PAYLOAD_TOO_LARGE, f"{message}; {advice}" if advice else message)
