"""HTTP/1.x mechanics over h11 and trio, for both the host and the trainer client.

Connection handling, framing, limits and graceful close; nothing here knows what a route means.
"""

from trio_gym.http.client import (
    BodyFailed,
    ClientExchange,
    ConnectFailed,
    ConnectionPool,
    Endpoint,
    NoResponse,
    Response,
    StreamOpener,
    build_request,
    exchange,
    open_tcp,
    read_response_head,
)
from trio_gym.http.connection import HttpConnection, Traffic
from trio_gym.http.limits import HttpLimits
from trio_gym.http.messages import (
    ChunkedBody,
    declared_length,
    encode_json,
    read_body,
    read_request_head,
    send_body,
    send_empty,
    send_json,
    travels_in_a_header,
)
from trio_gym.http.transport import (
    ConnectionLost,
    SocketTransport,
    StreamTransport,
    Transport,
    transport_of,
)

__all__ = [
    "BodyFailed",
    "ChunkedBody",
    "ClientExchange",
    "ConnectFailed",
    "ConnectionPool",
    "ConnectionLost",
    "Endpoint",
    "HttpConnection",
    "HttpLimits",
    "NoResponse",
    "Response",
    "StreamOpener",
    "SocketTransport",
    "StreamTransport",
    "Traffic",
    "Transport",
    "declared_length",
    "encode_json",
    "exchange",
    "open_tcp",
    "read_body",
    "read_request_head",
    "build_request",
    "read_response_head",
    "send_body",
    "send_empty",
    "send_json",
    "transport_of",
    "travels_in_a_header",
]
