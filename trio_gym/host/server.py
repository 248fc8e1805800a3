"""Accepting connections, owning each one, routing its single request, stopping gracefully."""

from __future__ import annotations

import contextlib
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final

import h11
import trio

from trio_gym.errors import ErrorCode, WireError
from trio_gym.http import ConnectionLost, HttpConnection, read_request_head, send_empty, send_json
from trio_gym.logs import log_event

from .rollouts import answer_rollouts
from .state import Host

Handler = Callable[[Host, HttpConnection, h11.Request], Awaitable[None]]


async def _answer_health(host: Host, conn: HttpConnection, head: h11.Request) -> None:
    status, document = host.health()
    await send_json(conn, status, document)


async def _answer_options(host: Host, conn: HttpConnection, head: h11.Request) -> None:
    # RFC 9110 §9.3.7: an OPTIONS answer with no content must say Content-Length: 0. Load
    # balancers probe with "OPTIONS / HTTP/1.0" (HAProxy's default), so this is a real path.
    await send_empty(conn, 200, headers=[("allow", _allowed(_route_path(head)))])


ROUTES: Final[dict[str, dict[bytes, Handler]]] = {
    "/health": {b"GET": _answer_health, b"OPTIONS": _answer_options},
    "/rollouts/run": {b"POST": answer_rollouts, b"OPTIONS": _answer_options},
    "*": {b"OPTIONS": _answer_options},
}


def _route_path(head: h11.Request) -> str:
    # Absolute-form targets (http://host/health) are legal and sent by some proxies.
    return urllib.parse.urlsplit(head.target.decode("ascii", "replace")).path or "/"


def _allowed(path: str) -> str:
    if path == "*":
        return "GET, POST, OPTIONS"
    return ", ".join(method.decode() for method in ROUTES[path])


async def _route(host: Host, conn: HttpConnection, head: h11.Request, *, busy: bool) -> None:
    if busy:
        raise _busy(host)
    path = "*" if head.target == b"*" else _route_path(head)
    methods = ROUTES.get(path)
    if methods is None:
        raise WireError(
            ErrorCode.NOT_FOUND,
            f"no such path {path!r}; this host serves GET /health and POST /rollouts/run",
        )
    handler = methods.get(head.method)
    if handler is None:
        allowed = _allowed(path)
        raise WireError(
            ErrorCode.METHOD_NOT_ALLOWED,
            f"{head.method.decode('ascii', 'replace')} is not allowed on {path}; use {allowed}",
            headers=[("allow", allowed)],
        )
    await handler(host, conn, head)


def _busy(host: Host) -> WireError:
    return WireError(
        ErrorCode.HOST_BUSY,
        f"the host is serving its maximum of {host.config.max_connections} connections; "
        "retry shortly, or raise max_connections (NMP_MAX_CONNECTIONS)",
        headers=[("retry-after", "1")],
    )


async def _answer(host: Host, conn: HttpConnection, *, busy: bool) -> None:
    """Read the request and answer it; a refusal of any kind is answered here, in one place."""
    try:
        head = await read_request_head(conn)
        await _route(host, conn, head, busy=busy)
    except WireError as refusal:
        log_event("refused", status=refusal.status, code=refusal.code.value, reason=refusal.message)
        await send_json(conn, refusal.status, refusal.envelope(), headers=refusal.headers)


async def handle_connection(host: Host, stream: trio.abc.Stream) -> None:
    """Own one connection from accept to close: one request, one answer, a graceful close.

    Never raises (but ``Cancelled``): whatever a caller sends, the server outlives it. A bug
    surfacing here is logged with its traceback, and answered 500 if no answer has started.
    """
    conn = HttpConnection(stream, h11.SERVER, host.limits)
    try:
        host.connection_slots.acquire_nowait()
    except trio.WouldBlock:
        busy = True
    else:
        busy = False
        host.stats.connections_open += 1
    try:
        await _answer(host, conn, busy=busy)
        await conn.close()
    except ConnectionLost as exc:
        log_event("caller_gone", reason=str(exc))
    except Exception:  # the boundary: a bug must not take the server down with it
        log_event("connection_failed", level=logging.ERROR, exc_info=True)
        await _answer_internal_error(conn)
    finally:
        await conn.aclose()
        if not busy:
            host.stats.connections_open -= 1
            host.connection_slots.release()


async def _answer_internal_error(conn: HttpConnection) -> None:
    if not conn.can_send_response:
        return
    error = WireError(ErrorCode.INTERNAL, "the host failed unexpectedly; its log has the details")
    with contextlib.suppress(ConnectionLost):
        await send_json(conn, error.status, error.envelope())


async def serve(
    host: Host, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Bootstrap and serve until :meth:`Host.request_shutdown`, then stop gracefully.

    Reports the bound port through ``task_status`` as soon as the socket listens (before the
    runner is loaded: ``/health`` answers ``starting`` meanwhile). On shutdown: stop accepting,
    let in-flight batches answer ``shutting_down``, and cut whatever is still open after
    ``shutdown_grace_s`` (each write is bounded by ``send_timeout_s``, so the process is gone
    within their sum).
    """
    config = host.config
    listeners = await trio.open_tcp_listeners(config.port, host=config.host)
    port: int = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as server_tasks:
            server_tasks.start_soon(host.bootstrap)
            server_tasks.start_soon(
                partial(
                    trio.serve_listeners,
                    partial(handle_connection, host),
                    listeners,
                    handler_nursery=connections,
                )
            )
            log_event("listening", host=config.host, port=port)
            task_status.started(port)
            await host.shutdown_requested.wait()
            server_tasks.cancel_scope.cancel()
        log_event("stopped_accepting", open_connections=host.stats.connections_open)
        connections.cancel_scope.deadline = trio.current_time() + config.shutdown_grace_s
    log_event("stopped")
