"""A buffered answer read as a chunk's results or as the :class:`RolloutError` naming its origin
(DESIGN §5; the whole table, with the failures before any answer, is in
:mod:`trio_gym.trainer.client`)."""

from __future__ import annotations

import json
from typing import Any

from trio_gym.errors import ErrorCode, quote_body

from .errors import Origin, RolloutError


def _nested_error(document: Any) -> tuple[str, str] | None:
    if isinstance(document, dict) and set(document) == {"error"}:
        error = document["error"]
        if isinstance(error, dict) and isinstance(error.get("code"), str):
            return error["code"], str(error.get("message", ""))
    return None


def decode_response(status: int, body: bytes, *, elapsed_s: float = 0.0) -> list[Any]:
    """Turn one response into the chunk's results, or raise the :class:`RolloutError` for it."""
    try:
        document, parsed = json.loads(body.decode("utf-8")), True
    except (ValueError, RecursionError):  # not UTF-8 (a ValueError), not JSON, or absurdly deep
        document, parsed = None, False
    nested = _nested_error(document) if parsed else None
    if not 200 <= status < 300:
        if nested is not None:
            code, message = nested
            origin = (
                Origin.CLIENT
                if code == ErrorCode.PAYLOAD_TOO_LARGE and status == 413
                else Origin.SANDBOX
            )
            raise RolloutError(
                f"the host refused the request with HTTP {status} {code}: {message}",
                origin=origin,
                retryable=False,
                status=status,
                code=code,
            )
        if status == 413:  # whoever said it, the request is too large: re-sending cannot help
            raise RolloutError(
                f"HTTP 413 from something in front of the host: the request is too large for "
                f"it; lower the chunk size. Body: {quote_body(body)}",
                origin=Origin.CLIENT,
                retryable=False,
                status=status,
            )
        if isinstance(document, dict) and {"code", "message"} <= set(document):
            raise RolloutError(
                f"a proxy answered HTTP {status} {document['code']}: {document['message']}",
                origin=Origin.PROXY,
                retryable=False,
                status=status,
                code=str(document["code"]),
            )
        raise RolloutError(
            f"HTTP {status} with a body the host never sends (a proxy's page?): {quote_body(body)}",
            origin=Origin.PROXY,
            retryable=True,
            status=status,
        )
    if not body.strip():
        late = (
            f" After {elapsed_s:.0f} s, a proxy read timeout is as likely: a proxy log with a "
            "timeout says proxy, a restarted or OOMKilled host says host."
            if elapsed_s > 30
            else ""
        )
        raise RolloutError(
            f"HTTP {status} with only heartbeat whitespace ({len(body)} bytes): the host "
            f"stopped answering mid-batch (killed, out of memory, evicted).{late}",
            origin=Origin.SANDBOX,
            retryable=False,
            status=status,
        )
    if not parsed:
        raise RolloutError(
            f"HTTP {status} with a body that is not UTF-8 JSON: {quote_body(body)}",
            origin=Origin.SANDBOX,
            retryable=False,
            status=status,
        )
    if nested is not None:
        code, message = nested
        raise RolloutError(
            f"the host failed the batch: {code}: {message}",
            origin=Origin.SANDBOX,
            retryable=False,
            status=status,
            code=code,
        )
    if not isinstance(document, dict) or not isinstance(document.get("results"), list):
        raise RolloutError(
            f"HTTP {status} with a document of unexpected shape: {quote_body(body)}",
            origin=Origin.SANDBOX,
            retryable=False,
            status=status,
        )
    results: list[Any] = document["results"]
    return results
