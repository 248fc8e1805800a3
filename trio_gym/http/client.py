"""The client half: where a URL points, sending a request, reading the response head.

Bodies are read with :func:`trio_gym.http.messages.read_body`, the same reader the host uses,
so there is one parser for both directions.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

import attrs
import h11

from trio_gym.http.connection import HttpConnection
from trio_gym.http.messages import send_message


@attrs.frozen
class Endpoint:
    """Where an ``http://`` URL points: host, port, and the base path requests are joined to."""

    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        """Parse ``http://host[:port][/base]``; raises ``ValueError`` naming what is wrong."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"{url!r}: only http:// URLs are supported (got {parts.scheme!r})")
        if not parts.hostname:
            raise ValueError(f"{url!r}: the URL names no host")
        return cls(parts.hostname, parts.port or 80, parts.path.rstrip("/"))

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def target(self, path: str) -> str:
        return f"{self.base_path}{path}"


async def send_request(
    conn: HttpConnection,
    endpoint: Endpoint,
    method: str,
    path: str,
    body: bytes,
    *,
    headers: Sequence[tuple[str, str]] = (),
) -> None:
    """Send one request framed by ``Content-Length`` (``0`` included).

    Raises :class:`~trio_gym.http.connection.ConnectionLost` if the peer is gone.
    """
    request = h11.Request(
        method=method,
        target=endpoint.target(path),
        headers=[
            ("host", endpoint.authority),
            ("content-length", str(len(body))),
            ("connection", "close"),
            *headers,
        ],
    )
    await send_message(conn, request, body)


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
