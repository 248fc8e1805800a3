"""What a trainer knows of a host it did not start by hand: where it is and how it is.

A :class:`HostHandle` is what a provider (:mod:`trio_gym.fleet`) hands back for each host it
launched, and what a :class:`~trio_gym.trainer.pool.HostPool` spreads work over. :func:`probe`
asks a host's ``/health`` once, within a bound, and says what it heard in one word and a
sentence: a pool probes a host that failed a request, a provider waits for ``ready``.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Protocol

import attrs
import trio

from trio_gym.errors import ErrorCode
from trio_gym.http import (
    BodyFailed,
    Endpoint,
    HttpLimits,
    NoResponse,
    StreamOpener,
    exchange,
    open_tcp,
    travels_in_a_header,
)
from trio_gym.protocol.host_identity import (
    HEALTH_IDENTITY_FIELD,
    HOST_IDENTITY_HEADER,
    identity_digest,
)
from trio_gym.protocol.rollouts import HEALTH_PATH
from trio_gym.trainer.gateways import backend_never_reached

# A /health answer is a few hundred bytes; anything much bigger is not one.
_MAX_HEALTH_BYTES = 64 * 1024


@attrs.frozen
class HostHandle:
    """One launched host: a name unique in its launch, its base URL, the headers every request
    to it carries (a sandbox platform's proxy may want its own), its control token."""

    name: str
    url: str
    headers: tuple[tuple[str, str], ...] = attrs.field(default=(), repr=False)
    """Kept out of ``repr``: a platform's headers may carry its API key."""
    control_token: str = attrs.field(default="", repr=False)
    identity: str = attrs.field(default="", repr=False)
    """Given by the provider that launched the host (``NMP_HOST_IDENTITY``): every request
    carries it, and the host refuses one carrying another."""

    def request_headers(self) -> tuple[tuple[str, str], ...]:
        """The headers every request to this host carries."""
        if not self.identity:
            return self.headers
        return (*self.headers, (HOST_IDENTITY_HEADER, self.identity))


def read_identity(path: Path) -> str:
    """The identity held in ``path``, its line's end (CRLF too) dropped; ``ValueError`` naming
    the file — never its content — when it cannot be read or cannot travel in a header."""
    try:
        identity = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not ASCII"
        raise ValueError(f"cannot read the identity file {path}: {reason}") from None
    if not identity or not travels_in_a_header(identity):
        raise ValueError(
            f"the identity file {path} holds no identity on one line of visible ASCII "
            "(its content is not shown)"
        )
    return identity


class HealthStatus(enum.StrEnum):
    READY = "ready"
    STARTING = "starting"
    FAILED = "failed"
    SHUTTING_DOWN = "shutting_down"
    UNREACHABLE = "unreachable"
    """No answer: refused, reset, or nothing within the probe's bound."""
    UNKNOWN = "unknown"
    """An answer that is not a trio_gym ``/health`` document (a proxy's page)."""
    WRONG_HOST = "wrong_host"
    """A host answers at the address, but not the one launched there (the address was reused)."""
    BUSY = "busy"
    """The host answers, but is serving its maximum of connections or batches (``host_busy``)."""
    NOT_READY = "not_ready"
    """Not ready, and nothing more: all a host launched with an identity tells a caller
    without it."""


@attrs.frozen
class Health:
    status: HealthStatus
    detail: str
    """What was heard, for a person: the stage and message of a failed host, the error of an
    unreachable one."""


async def probe(
    handle: HostHandle,
    *,
    timeout_s: float,
    opener: StreamOpener = open_tcp,
    limits: HttpLimits | None = None,
) -> Health:
    """One ``GET /health`` of ``handle``, answered within ``timeout_s`` or called unreachable."""
    endpoint = Endpoint.parse(handle.url)
    with trio.move_on_after(timeout_s):
        try:
            response = await exchange(
                endpoint,
                "GET",
                HEALTH_PATH,
                limits=limits or HttpLimits(),
                max_response_bytes=_MAX_HEALTH_BYTES,
                idle_timeout_s=timeout_s,
                headers=handle.request_headers(),
                opener=opener,
            )
        except (NoResponse, BodyFailed) as exc:
            return Health(HealthStatus.UNREACHABLE, str(exc))
        return read_health(response.status, response.body, identity=handle.identity)
    return Health(HealthStatus.UNREACHABLE, f"no answer to GET /health within {timeout_s:g} s")


def read_health(status: int, body: bytes, *, identity: str = "") -> Health:
    """A ``/health`` answer in one word and a sentence; a host that holds another identity
    than ``identity`` (when given) is :attr:`HealthStatus.WRONG_HOST`."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        document = None
    if isinstance(document, dict) and _refusal_code(document) == ErrorCode.WRONG_HOST:
        return Health(HealthStatus.WRONG_HOST, f"HTTP {status}: another host answers here")
    if isinstance(document, dict) and _refusal_code(document) == ErrorCode.HOST_BUSY:
        return Health(HealthStatus.BUSY, f"HTTP {status}: serving its maximum of connections")
    try:
        word = HealthStatus(document["status"])
    except (ValueError, TypeError, KeyError):
        if backend_never_reached(status, body):
            return Health(HealthStatus.UNREACHABLE, f"a gateway's HTTP {status}: {body[:200]!r}")
        shown = body[:200].decode("utf-8", "replace")
        return Health(HealthStatus.UNKNOWN, f"HTTP {status} that is not a host's health: {shown!r}")
    assert isinstance(document, dict)
    held = document.get(HEALTH_IDENTITY_FIELD)
    if identity and held != identity_digest(identity):
        return Health(
            HealthStatus.WRONG_HOST,
            f"HTTP {status}: the host here holds "
            + ("no identity" if held is None else "another identity")
            + ", not the one launched here (its address was reused)",
        )
    if word is HealthStatus.READY and status != 200:
        return Health(HealthStatus.UNKNOWN, f"HTTP {status} saying ready")
    detail = f"HTTP {status} {word.value}"
    if isinstance(document.get("stage"), str):
        detail += f" at stage {document['stage']}"
    error = document.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        detail += f": {error['message']}"
    elif isinstance(document.get("detail"), str):
        detail += f" ({document['detail']})"
    return Health(word, detail)


class LaunchFailed(Exception):
    """A host could not be launched or did not become ready; the message names the host, what
    was seen (its ``/health``, its exit status) and the end of its log."""


class Launcher(Protocol):
    """What a pool asks of whoever launched its hosts (every provider is one)."""

    async def alive(self, handle: HostHandle) -> bool:
        """Whether the host's process (or sandbox) still exists; not whether it is healthy."""
        ...

    async def replace(self, handle: HostHandle) -> HostHandle:
        """Stop ``handle``'s host and launch another in its place, ready; its handle."""
        ...


def _refusal_code(document: dict[str, object]) -> object:
    error = document.get("error")
    return error.get("code") if isinstance(error, dict) else None
