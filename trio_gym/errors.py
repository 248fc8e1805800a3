"""The error codes of the wire contract and the exception that carries them.

Every refusal the host makes, and every failure it reports after the status line has left,
is a :class:`WireError`: a machine-readable ``code``, a human ``message`` that says what was
wrong and what to do, and the HTTP ``status`` it is answered with. Before the status line, one
place in the host turns a ``WireError`` into a response (``_answer`` in
:mod:`trio_gym.host.server`); after it, the rollouts route puts the envelope into the
document. The trainer client turns the envelope back into an exception. Nothing else invents
status codes.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import pydantic

E = TypeVar("E", bound=BaseException)


class ErrorCode(enum.StrEnum):
    """Every ``error.code`` the host can put in an envelope or a document."""

    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NOT_ACCEPTABLE = "not_acceptable"
    REQUEST_TIMEOUT = "request_timeout"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    HEADERS_TOO_LARGE = "headers_too_large"
    NOT_IMPLEMENTED = "not_implemented"
    NOT_READY = "not_ready"
    BOOTSTRAP_FAILED = "bootstrap_failed"
    HOST_BUSY = "host_busy"
    SHUTTING_DOWN = "shutting_down"
    HTTP_VERSION_NOT_SUPPORTED = "http_version_not_supported"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"
    UNAUTHORIZED = "unauthorized"
    WRONG_HOST = "wrong_host"
    IDENTITY_REQUIRED = "identity_required"
    ADMISSION_CLOSED = "admission_closed"
    STALE_ATTEMPT = "stale_attempt"
    STALE_CHECKPOINT = "stale_checkpoint"
    CHECKPOINT_CONFLICT = "checkpoint_conflict"
    WRONG_PHASE = "wrong_phase"
    EXPORT_INVALID = "export_invalid"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    ANSWER_EXPIRED = "answer_expired"


# The status each code is answered with when it is still possible to choose one. A
# ``payload_too_large`` about the *response* is a 500 (the caller's request was fine); that
# one case passes its status explicitly.
DEFAULT_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.NOT_ACCEPTABLE: 406,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.HEADERS_TOO_LARGE: 431,
    ErrorCode.NOT_IMPLEMENTED: 501,
    ErrorCode.NOT_READY: 503,
    ErrorCode.BOOTSTRAP_FAILED: 503,
    ErrorCode.HOST_BUSY: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.HTTP_VERSION_NOT_SUPPORTED: 505,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.WRONG_HOST: 421,
    ErrorCode.IDENTITY_REQUIRED: 403,
    ErrorCode.ADMISSION_CLOSED: 409,
    ErrorCode.STALE_ATTEMPT: 409,
    ErrorCode.STALE_CHECKPOINT: 409,
    ErrorCode.CHECKPOINT_CONFLICT: 409,
    ErrorCode.WRONG_PHASE: 409,
    ErrorCode.EXPORT_INVALID: 422,
    ErrorCode.IDEMPOTENCY_KEY_REUSED: 422,
    ErrorCode.ANSWER_EXPIRED: 410,
}


class WireError(Exception):
    """A failure with its place in the wire contract.

    ``headers`` are extra response headers the refusal needs (``Allow`` on a 405,
    ``Retry-After`` on a busy 503). ``status`` defaults to the code's :data:`DEFAULT_STATUS`.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        status: int | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = DEFAULT_STATUS[code] if status is None else status
        self.headers = tuple(headers)

    def envelope(self) -> dict[str, Any]:
        """The ``{"error": {"code", "message"}}`` body every refusal carries."""
        return {"error": {"code": self.code.value, "message": self.message}}

    def __repr__(self) -> str:
        return f"WireError({self.code.value!r}, {self.message!r}, status={self.status})"


def leaves(group: BaseExceptionGroup[E]) -> list[E]:
    """The exceptions of a (possibly nested) group, in order."""
    found: list[E] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found.extend(leaves(exc))
        else:
            found.append(exc)
    return found


def raise_unwrapped(
    group: BaseExceptionGroup[BaseException], *, alike: type[BaseException] | None = None
) -> NoReturn:
    """Raise what a nursery's failure should surface as, with no error lost; call it in the
    ``except`` clause that caught ``group``.

    A single error is raised as itself (a nursery wraps even one), its own cause kept and the
    group it came in not shown. Several errors all of type ``alike`` (the one the caller
    catches) raise the first, every other's message added to it as a note. Anything else
    raises the whole group.
    """
    found = leaves(group)
    if len(found) > 1 and alike is not None and all(isinstance(exc, alike) for exc in found):
        for other in found[1:]:
            found[0].add_note(f"also: {type(other).__name__}: {other}")
        found = found[:1]
    if len(found) == 1:
        found[0].__suppress_context__ = True
        raise found[0]
    raise group


def shown(data: bytes, limit: int = 100) -> str:
    """Bytes a caller sent, as a message may show them — the one way the host echoes a caller:
    visible ASCII and spaces as they are, any other byte as ``\\xNN``, at most ``limit``
    bytes (then how many there were in all)."""
    text = "".join(chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}" for b in data[:limit])
    return text if len(data) <= limit else f"{text}... ({len(data)} bytes)"


def bounded(text: str, limit: int = 1000) -> str:
    """A message made elsewhere (a runner's, a validator's), cut to ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


REDACTED = "<redacted>"
MAX_PROBLEMS_SHOWN = 10
# The user information of a URL (``scheme://user:password@host``): a credential.
_USERINFO = re.compile(r"(//)[^/@\s]+@")


def without_userinfo(text: str) -> str:
    """``text`` with every URL's user information replaced by :data:`REDACTED`."""
    return _USERINFO.sub(rf"\1{REDACTED}@", text)


def readable_body(body: bytes, limit: int = 500) -> str:
    """The start of a peer's error body as text for a message, decoded once: a body that is a
    JSON string (how Gym's servers answer a failure) is that string, not its escaped JSON."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        value = None
    text = value if isinstance(value, str) else body.decode("utf-8", "replace")
    return f"{text[:limit]} ... ({len(body)} bytes)" if len(text) > limit else text


def quote_body(body: bytes, limit: int = 500) -> str:
    """The start of a body, quoted for an error message, with its full length if cut."""
    text = repr(body[:limit].decode("utf-8", "replace"))
    return f"{text} ... ({len(body)} bytes)" if len(body) > limit else text


def describe_validation_error(
    exc: pydantic.ValidationError,
    sources: Mapping[str, str] | None = None,
    *,
    secrets: frozenset[str] = frozenset(),
) -> str:
    """Every problem on one line: where the value came from, what it was, what is wrong —
    the first ``MAX_PROBLEMS_SHOWN``, then how many more (a body of a million bad rows is not
    answered with a million lines)."""
    problems = validation_problems(exc, sources, secrets=secrets)
    more = len(problems) - MAX_PROBLEMS_SHOWN
    shown_problems = problems[:MAX_PROBLEMS_SHOWN]
    if more > 0:
        shown_problems.append(f"and {more} more problem(s)")
    return "; ".join(bounded(problem) for problem in shown_problems)


def validation_problems(
    exc: pydantic.ValidationError,
    sources: Mapping[str, str] | None = None,
    *,
    secrets: frozenset[str] = frozenset(),
) -> list[str]:
    """One entry per problem: where the value came from, what it was, what is wrong.

    A value is shown, to say what was wrong with it, except a secret's: a field in
    ``secrets`` shows :data:`~trio_gym.errors.REDACTED`, and any URL's user information is
    redacted wherever it appears (the logs an error lands in are kept by the platform)."""
    lines = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"])
        key = str(error["loc"][0]) if error["loc"] else ""
        where = (sources or {}).get(key, location)
        message = without_userinfo(error["msg"].removeprefix("Value error, "))
        if error["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key {location!r}")
        elif not location:
            lines.append(message)
        elif "input" in error and where != location:
            shown = REDACTED if key in secrets else without_userinfo(repr(error["input"]))
            lines.append(f"{where}={shown}: {message}")
        else:
            lines.append(f"{location}: {message}")
    return lines
