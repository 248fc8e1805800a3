"""What a gateway in front of a host says when it never reached the host: the request went
nowhere, so no host took it (measured on OpenSandbox's server proxy; the others as their
documentation words them)."""

from __future__ import annotations

import json
import re

GATEWAY_STATUSES: frozenset[int] = frozenset({502, 503, 504})
# A gateway's own words for "I never reached the backend": the request went nowhere. A flat
# envelope's code (OpenSandbox's server proxy) or a body's text (Envoy's connect failures, a
# proxy's "could not connect"); anything else a gateway says may hide a request it forwarded.
_BACKEND_NEVER_REACHED_CODES: frozenset[str] = frozenset({"BACKEND_CONNECTION_FAILED"})
_BACKEND_NEVER_REACHED_TEXT = re.compile(
    rb"could not connect to the backend|no healthy upstream|"
    rb"upstream connect error[^\n]*reset reason: (remote )?connection (failure|timeout)",
    re.IGNORECASE,
)


def backend_never_reached(status: int, body: bytes) -> bool:
    """Whether a gateway says it could not reach the backend (so no host took the request)."""
    if status not in GATEWAY_STATUSES:
        return False
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        document = None
    if isinstance(document, dict) and document.get("code") in _BACKEND_NEVER_REACHED_CODES:
        return True
    return _BACKEND_NEVER_REACHED_TEXT.search(body[:4096]) is not None
