"""A buffered answer read as a chunk's results or as the :class:`RolloutError` naming its origin
and whether a host took it (the whole table, with the failures before any answer and the cut
answers, is in :mod:`trio_gym.trainer.host_client`)."""

from __future__ import annotations

import json
from typing import Any

from trio_gym.errors import ErrorCode, quote_body
from trio_gym.http import HttpLimits, StreamOpener

from .errors import Origin, Reach, RolloutError
from .gateways import GATEWAY_STATUSES, backend_never_reached
from .hosts import HealthStatus, HostHandle, probe

# The host's refusals that mean "not now, not this host": the request was not admitted and
# another host (or this one later) may take it.
HOST_NOT_NOW: frozenset[str] = frozenset(
    {
        ErrorCode.NOT_READY,
        ErrorCode.BOOTSTRAP_FAILED,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.WRONG_HOST,
        ErrorCode.HOST_BUSY,
        ErrorCode.ADMISSION_CLOSED,
    }
)


def _nested_error(document: Any) -> tuple[str, str] | None:
    if isinstance(document, dict) and set(document) == {"error"}:
        error = document["error"]
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            return error["code"], str(error.get("message", ""))
    return None


def is_cut(status: int, body: bytes) -> bool:
    """A 2xx whose body is heartbeats only: the answer was cut (a proxy in front may end a cut
    body cleanly, so framing alone cannot tell it from a whole one)."""
    return 200 <= status < 300 and not body.strip()


def decode_response(status: int, body: bytes, *, page_reach: Reach = Reach.UNREACHED) -> list[Any]:
    """Turn one whole response into the chunk's results, or raise the :class:`RolloutError` for
    it. A cut answer (:func:`is_cut`) is the caller's to name: it asks the host first.
    ``page_reach`` is what a proxy's unrecognised page means: unreached over HTTP/1.1 (the host
    would have sent its head), taken over 1.0 (a buffering proxy's page may hide a batch run)."""
    try:
        document, parsed = json.loads(body.decode("utf-8")), True
    except (ValueError, RecursionError):  # not UTF-8 (a ValueError), not JSON, or absurdly deep
        document, parsed = None, False
    nested = _nested_error(document) if parsed else None
    if not 200 <= status < 300:
        if nested is not None:
            code, message = nested
            too_large = code == ErrorCode.PAYLOAD_TOO_LARGE and status == 413
            not_now = code in HOST_NOT_NOW
            raise RolloutError(
                f"the host refused the request with HTTP {status} {code}: {message}",
                origin=Origin.CLIENT if too_large else Origin.SANDBOX,
                reach=Reach.UNREACHED if not_now else Reach.REFUSED,
                suspect=not_now,  # probed before it gets more: no tight loop of re-sends
                status=status,
                code=code,
            )
        if status == 413:  # whoever said it, the request is too large: re-sending cannot help
            raise RolloutError(
                f"HTTP 413 from something in front of the host: the request is too large for "
                f"it; lower the chunk size. Body: {quote_body(body)}",
                origin=Origin.CLIENT,
                reach=Reach.REFUSED,
                status=status,
            )
        if backend_never_reached(status, body):
            raise RolloutError(
                f"a gateway answered HTTP {status}: it could not reach the host, so no host "
                f"took the request: {quote_body(body)}",
                origin=Origin.PROXY,
                reach=Reach.UNREACHED,
                suspect=True,
                status=status,
            )
        if isinstance(document, dict) and {"code", "message"} <= set(document):
            raise RolloutError(
                f"a proxy answered HTTP {status} {document['code']}: {document['message']}",
                origin=Origin.PROXY,
                reach=Reach.TAKEN,
                suspect=status in GATEWAY_STATUSES,
                status=status,
                code=str(document["code"]),
            )
        raise RolloutError(
            f"HTTP {status} with a body the host never sends (a proxy's page?): {quote_body(body)}",
            origin=Origin.PROXY,
            reach=page_reach,
            suspect=True,
            status=status,
        )
    if not parsed:
        raise RolloutError(
            f"HTTP {status} with a body that is not UTF-8 JSON: {quote_body(body)}",
            origin=Origin.SANDBOX,
            reach=Reach.TAKEN,
            status=status,
        )
    if nested is not None:
        code, message = nested
        raise RolloutError(
            f"the host failed the batch: {code}: {message}",
            origin=Origin.SANDBOX,
            reach=Reach.TAKEN,
            status=status,
            code=code,
        )
    if not isinstance(document, dict) or not isinstance(document.get("results"), list):
        raise RolloutError(
            f"HTTP {status} with a document of unexpected shape: {quote_body(body)}",
            origin=Origin.SANDBOX,
            reach=Reach.TAKEN,
            status=status,
        )
    results: list[Any] = document["results"]
    return results


# What a host that still runs answers (a restarted one says it is starting: its batch died).
_ALIVE: frozenset[HealthStatus] = frozenset(
    {HealthStatus.READY, HealthStatus.BUSY, HealthStatus.SHUTTING_DOWN, HealthStatus.FAILED}
)


async def named_cut(
    host: HostHandle,
    what: str,
    *,
    status: int,
    timeout_s: float,
    opener: StreamOpener,
    limits: HttpLimits,
) -> RolloutError:
    """The error of an answer cut after the host took the chunk (``what`` says how it ended),
    its origin decided by asking the host: gone (or restarted) means it died mid-batch; alive
    means something between cut the answer. Either way it is never re-sent."""
    health = await probe(host, timeout_s=timeout_s, opener=opener, limits=limits)
    if health.status in _ALIVE:
        where = (
            f"while the host still answers (GET /health: {health.detail}): something between "
            "cut the answer — look at the proxy's idle timeout (OpenSandbox's is 180 s without a "
            "byte) and its log, or a dropped connection"
        )
        origin = Origin.PROXY
    else:
        where = (
            f"and the host is gone or restarted (GET /health: {health.detail}): it stopped "
            "mid-batch — look at its platform for why (killed, out of memory, evicted)"
        )
        origin = Origin.SANDBOX
    return RolloutError(
        f"{what}, {where}; not re-sent: the host had started these examples, and a second copy "
        "would run them twice",
        origin=origin,
        reach=Reach.TAKEN,
        suspect=True,
        status=status,
    )
