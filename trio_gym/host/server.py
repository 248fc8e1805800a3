"""Accepting connections, owning each one, routing its single request, stopping gracefully."""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Final

import trio

from trio_gym.config import ServeConfig
from trio_gym.errors import ErrorCode, WireError, leaves, shown
from trio_gym.files import write_whole
from trio_gym.http import (
    ConnectionLost,
    HttpConnection,
    SocketTransport,
    StreamTransport,
    read_request_head,
    send_empty,
    send_json,
)
from trio_gym.http.h11_build import h11
from trio_gym.http.transport import STREAM_BUFFER_BYTES, Transport
from trio_gym.logs import log_event
from trio_gym.protocol.control import STATUS
from trio_gym.protocol.host_identity import HOST_IDENTITY_HEADER
from trio_gym.protocol.rollouts import HEALTH_PATH, METRICS_PATH, RUN_PATH

from .admission import Ticket, host_busy
from .control import CARRY_OUT, answer_operation, answer_status
from .metrics import answer_metrics
from .rollouts import answer_rollouts, cancel_keyed
from .state import Host, Services

Handler = Callable[[Services, HttpConnection, h11.Request], Awaitable[None]]


class ListenError(Exception):
    """The host could not open its listening socket (or say where it listens); the message says
    what to change."""


def _health(services: Services) -> tuple[int, dict[str, object], tuple[tuple[str, str], ...]]:
    """What ``/health`` says now: the lifecycle's answer, or ``host_busy`` while the batches
    that may run are all running (a batch would not be accepted)."""
    status, document = services.lifecycle.health()
    if status == 200:
        try:
            services.check_batch_room()
        except WireError as busy:
            return busy.status, busy.envelope(), busy.headers
    return status, document, ()


async def _answer_health(services: Services, conn: HttpConnection, head: h11.Request) -> None:
    status, document, headers = _health(services)
    await send_json(conn, status, document, headers=headers)


async def _answer_health_to_stranger(
    services: Services, conn: HttpConnection, head: h11.Request, *, busy: bool
) -> None:
    """A host launched with an identity tells a caller without it whether it is ready, and
    nothing more (no stage, no error, no digest)."""
    ready = not busy and _health(services)[0] == 200
    await send_json(conn, 200 if ready else 503, {"status": "ready" if ready else "not_ready"})


async def _answer_options(services: Services, conn: HttpConnection, head: h11.Request) -> None:
    # RFC 9110 §9.3.7: an OPTIONS answer with no content must say Content-Length: 0. Load
    # balancers probe with "OPTIONS / HTTP/1.0" (HAProxy's default), so this is a real path.
    path = route_path(head.target)
    allowed = _allowed(path) if path != "*" else _all_methods()
    await send_empty(conn, 200, headers=[("allow", allowed)])


ROUTES: Final[dict[str, dict[bytes, Handler]]] = {
    HEALTH_PATH: {b"GET": _answer_health, b"OPTIONS": _answer_options},
    METRICS_PATH: {b"GET": answer_metrics, b"OPTIONS": _answer_options},
    RUN_PATH: {
        b"POST": answer_rollouts,
        b"DELETE": cancel_keyed,
        b"OPTIONS": _answer_options,
    },
    STATUS.path: {b"GET": answer_status},
    **{op.path: {b"POST": partial(answer_operation, op)} for op in CARRY_OUT},
    "*": {b"OPTIONS": _answer_options},  # the server as a whole (RFC 9110 §9.3.7)
}


# A full host is when an operator most wants to look at it: its overflow connections (short
# timeouts, a bounded number) still answer its metrics. (/health stays 503 host_busy: it says
# whether a batch would be accepted, and one would not.)
WATCHED_WHEN_BUSY: Final = frozenset({METRICS_PATH})


def route_path(target: bytes) -> str:
    """The path a request target names; raises ``invalid_request`` for anything else.

    Origin-form (``/health?x``) is the usual; absolute-form (``http://host/health``) is legal
    and sent by some proxies; ``*`` is for OPTIONS. Authority-form (``CONNECT host:443``) and
    garbage are not paths.
    """
    text = target.decode("ascii", "replace")  # h11 let through visible ASCII only
    if text == "*":
        return text
    if text.startswith("/"):
        return text.partition("?")[0]
    if text.lower().startswith(("http://", "https://")):
        try:
            return urllib.parse.urlsplit(text).path or "/"
        except ValueError as exc:
            raise WireError(
                ErrorCode.INVALID_REQUEST, f"malformed request target {shown(target)}"
            ) from exc
    raise WireError(
        ErrorCode.INVALID_REQUEST,
        f"the request target {shown(target)} is not a path; send e.g. POST /rollouts/run",
    )


def _allowed(path: str) -> str:
    return ", ".join(method.decode() for method in ROUTES[path])


def _all_methods() -> str:
    methods = {method for handlers in ROUTES.values() for method in handlers}
    return ", ".join(sorted(method.decode() for method in methods))


def _route(config: ServeConfig, head: h11.Request, *, busy: bool) -> Handler:
    """The handler of ``head``'s path and method; raises the refusal when there is none. (It
    returns the handler rather than awaiting it: a frame less kept by every held batch.)

    A host launched with an identity serves only callers that hold it: a caller without it
    may ask ``GET /health`` whether the host is ready, and nothing else; one with another
    identity is refused outright (before busy: a busy stranger is still a stranger)."""
    holder = _holds_identity(config.host_identity, head)
    path = route_path(head.target)
    if not holder:
        if head.method == b"GET" and path == HEALTH_PATH:
            return partial(_answer_health_to_stranger, busy=busy)
        raise WireError(
            ErrorCode.IDENTITY_REQUIRED,
            f"this host serves only the caller that launched it, which sends its identity in "
            f"{HOST_IDENTITY_HEADER}: send it (a provider's HostHandle does; see the README, "
            "'A host answers only the caller that launched it')",
        )
    if busy and not (head.method == b"GET" and path in WATCHED_WHEN_BUSY):
        raise _busy(config)
    methods = ROUTES.get(path)
    if methods is None:
        raise WireError(
            ErrorCode.NOT_FOUND,
            f"no such path {shown(path.encode())}; this host serves GET /health, GET /metrics "
            "and POST /rollouts/run",
        )
    handler = methods.get(head.method)
    if handler is None:
        allowed = _allowed(path)
        raise WireError(
            ErrorCode.METHOD_NOT_ALLOWED,
            f"{shown(head.method)} is not allowed on {shown(path.encode())}; use {allowed}",
            headers=[("allow", allowed)],
        )
    return handler


_IDENTITY_HEADER: Final = HOST_IDENTITY_HEADER.encode()


def _holds_identity(identity: str, head: h11.Request) -> bool:
    """Whether the request carries ``identity`` (everyone does when it is empty); refuses a
    request that carries another one, meant for another host (its address was this one's
    before). Neither value is named: the refusal would hand a stranger this host's identity."""
    if not identity:
        return True
    presented = [value for name, value in head.headers if name == _IDENTITY_HEADER and value]
    if not presented:
        return False
    expected = identity.encode()
    if not all([hmac.compare_digest(value, expected) for value in presented]):  # each compared
        raise WireError(
            ErrorCode.WRONG_HOST,
            f"this request's {HOST_IDENTITY_HEADER} is another host's: the identity sent is "
            "not the one this host was launched with (the host it was meant for may be gone, "
            "and this one now holds its address); check the identity, or ask that host's "
            "provider for the host it launched",
        )
    return True


def _busy(config: ServeConfig) -> WireError:
    serving = f"serving its maximum of {config.max_connections} connections"
    return host_busy(serving, "max_connections", "NMP_MAX_CONNECTIONS")


async def _refuse(
    services: Services, conn: HttpConnection, error: WireError, *, busy: bool
) -> None:
    """Answer a refusal of any kind, in one place. Whatever the head held, an over-cap
    connection hears the same answer — but a caller without this host's identity hears that."""
    about_identity = error.code in (ErrorCode.WRONG_HOST, ErrorCode.IDENTITY_REQUIRED)
    refusal = _busy(services.config) if busy and not about_identity else error
    services.stats.requests_refused[refusal.code.value] += 1
    if busy:  # over the cap (one that asked for /metrics was answered instead)
        services.stats.connections_refused["busy"] += 1
    log_event("refused", status=refusal.status, code=refusal.code.value, reason=refusal.message)
    await send_json(conn, refusal.status, refusal.envelope(), headers=refusal.headers)


async def handle_connection(
    host: Host, stream: trio.abc.Stream, *, buffer_bytes: int = STREAM_BUFFER_BYTES
) -> None:
    """Own one connection from accept to close: one request, one answer, a graceful close.

    Up to ``max_connections`` are served in full. Beyond that, a bounded overflow is answered
    503 ``host_busy`` on short timeouts; beyond the overflow too, a connection is closed at once,
    so a flood of sockets costs neither memory nor time. Never raises (but ``Cancelled``):
    whatever a caller sends, the server outlives it. A bug surfacing here is logged with its
    traceback, and answered 500 if no answer has started.

    ``stream`` is any trio stream. A socket's bytes are written and read directly; another
    stream's writes are queued, up to ``buffer_bytes`` (:class:`~trio_gym.http.StreamTransport`),
    and sent by a task of this connection's own beside the one answering.
    """
    if isinstance(stream, trio.SocketStream):
        await handle_socket(host, stream.socket)
        return
    ticket = _admit(host)
    if ticket is None:
        await stream.aclose()
        return
    limits = ticket.admitted.limits
    transport = StreamTransport(
        stream, send_timeout_s=limits.send_timeout_s, buffer_bytes=buffer_bytes
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(transport.send_queued_forever)
        await _answer(host.services, _connection(host, transport, ticket), ticket.admitted.busy)
        nursery.cancel_scope.cancel()


async def handle_socket(host: Host, sock: trio.socket.SocketType) -> None:
    """:func:`handle_connection` for an accepted socket, as the accept loop hands it over."""
    ticket = _admit(host)
    if ticket is None:
        sock.close()
        await trio.lowlevel.checkpoint()
        return
    await _answer(
        host.services, _connection(host, SocketTransport(sock), ticket), ticket.admitted.busy
    )


def _admit(host: Host) -> Ticket | None:
    ticket = host.admission.admit()
    if ticket is None:
        log_event("connection_dropped", reason="the connection cap and its overflow are full")
    return ticket


def _connection(host: Host, transport: Transport, ticket: Ticket) -> HttpConnection:
    """The server's side of an admitted connection; its place is given back when it closes
    (:func:`_answer` closes it, whatever happens)."""
    traffic = host.services.stats.traffic
    return HttpConnection(
        transport, h11.SERVER, ticket.admitted.limits, traffic=traffic, on_close=ticket.release
    )


async def _answer(services: Services, conn: HttpConnection, busy: bool) -> None:
    """Read the request, answer it, close. Never raises (but ``Cancelled``)."""
    config = services.config
    try:
        try:
            head = await read_request_head(conn)
            await _route(config, head, busy=busy)(services, conn, head)
        except WireError as error:
            await _refuse(services, conn, error, busy=busy)
        await conn.close()
    except* ConnectionLost as lost:
        log_event("caller_gone", reason=str(leaves(lost)[0]))
    # The boundary: a bug must not take the server down with it — not even one grouped with
    # the Cancelled of a shutdown's end (which goes on).
    except* Exception:
        log_event("connection_failed", level=logging.ERROR, exc_info=True)
        await _answer_internal_error(conn)
    finally:
        await conn.aclose()


async def _answer_internal_error(conn: HttpConnection) -> None:
    if not conn.can_send_response:
        return
    error = WireError(ErrorCode.INTERNAL, "the host failed unexpectedly; its log has the details")
    with contextlib.suppress(ConnectionLost):
        await send_json(conn, error.status, error.envelope())


# accept() errors that mean "out of file descriptors or memory for now": wait, then retry.
_ACCEPT_LATER_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_S: Final = 0.1
ACCEPTS_PER_WAKE: Final = 64


async def accept_connections(
    host: Host, listener: trio.SocketListener, connections: trio.Nursery
) -> None:
    """Accept forever, each connection handled in ``connections``.

    Every connection waiting is accepted in one go after one wake-up (at most
    ``ACCEPTS_PER_WAKE``), where ``trio.serve_listeners`` takes a trip through the scheduler for
    each and closes every stream again after its handler (a cancelled checkpoint: an exception
    raised and caught) though the handler has always closed it (NOTES.md has the measurement).
    """
    async with listener:
        # A second descriptor of the listening socket, as a standard socket: its accept() does
        # not wait (the listening socket is non-blocking) and is not a checkpoint.
        with socket.socket(fileno=os.dup(listener.socket.fileno())) as accepting:
            while True:
                await trio.lowlevel.wait_readable(accepting)
                for _ in range(ACCEPTS_PER_WAKE):
                    try:
                        accepted, _ = accepting.accept()
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if exc.errno not in _ACCEPT_LATER_ERRNOS:
                            raise
                        log_event(
                            "accept_failed",
                            level=logging.ERROR,
                            error=str(exc),
                            retry_s=ACCEPT_RETRY_S,
                        )
                        await trio.sleep(ACCEPT_RETRY_S)
                        break
                    accepted.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
                    sock = trio.socket.from_stdlib_socket(accepted)
                    connections.start_soon(handle_socket, host, sock)


def write_port_file(path: Path, port: int) -> None:
    """Write ``port`` to ``path`` whole (a temporary name, then a rename): a launcher polling for
    the file never reads half of it. Raises :class:`ListenError` if it cannot be written."""
    try:
        write_whole(path, f"{port}\n".encode())
    except OSError as exc:
        raise ListenError(
            f"listening on port {port}, but cannot write the port file {path}: "
            f"{exc.strerror or exc}; give --port-file (NMP_PORT_FILE) a writable path"
        ) from exc


async def serve(
    host: Host, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Bootstrap and serve until the lifecycle's ``request_shutdown``, then stop gracefully.

    Reports the bound port through ``task_status`` as soon as the socket listens (before the
    runner is loaded: ``/health`` answers ``starting`` meanwhile). On shutdown: let in-flight
    batches answer ``shutting_down`` (accepting until they have, so that ``/health`` and
    ``/metrics`` say so), and cut whatever is still open after ``shutdown_grace_s`` (each
    write is bounded by ``send_timeout_s``); then stop the services, a Gym deployment among
    them (within ``gym_stop_grace_s`` and a margin). The process is gone within the sum of
    those bounds.
    """
    config = host.config
    try:
        listeners = await trio.open_tcp_listeners(config.port, host=config.host)
    except OSError as exc:
        log_event(
            "listen_failed", level=logging.ERROR, host=config.host, port=config.port, error=str(exc)
        )
        raise ListenError(
            f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}; "
            "choose another --port (NMP_RUNTIME_HTTP_PORT) or stop what holds it"
        ) from exc
    port: int = listeners[0].socket.getsockname()[1]
    if config.port_file:
        write_port_file(Path(config.port_file), port)
    # Background tasks outlive every connection: batches answering during the shutdown grace
    # still beat and still reach the Gym deployment. They stop once the last connection closed.
    lifecycle, services = host.lifecycle, host.services
    async with trio.open_nursery() as background:
        background.start_soon(services.pacer.run)
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as server_tasks:
                server_tasks.start_soon(lifecycle.bootstrap, background)
                server_tasks.start_soon(services.checkpoints.watch_lease)
                for listener in listeners:
                    server_tasks.start_soon(accept_connections, host, listener, connections)
                log_event("listening", host=config.host, port=port)
                task_status.started(port)
                await lifecycle.shutdown_requested.wait()
                stop_at = trio.current_time() + config.shutdown_grace_s
                # Listening on while batches still run, within the grace: /health and /metrics
                # say shutting_down, and a new batch is refused so (not a refused connection).
                stats = services.stats
                with trio.move_on_at(stop_at):
                    await stats.batch_changes.until(lambda: stats.batches_running == 0)
                server_tasks.cancel_scope.cancel()
            log_event("stopped_accepting", open_connections=services.stats.connections_open)
            connections.cancel_scope.deadline = stop_at
        background.cancel_scope.cancel()
    await lifecycle.close_runner()
    log_event("stopped")
