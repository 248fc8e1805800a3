"""How the trainer names a failure: :class:`RolloutError` with its ``origin`` (where to look)
and its ``reach`` (whether a host took the chunk), both decided where the error is built; which
answer is which is :mod:`trio_gym.trainer.answers`."""

from __future__ import annotations

import enum
from typing import Any


class Origin(enum.StrEnum):
    SANDBOX = "sandbox"
    PROXY = "proxy"
    CLIENT = "client"


class Reach(enum.StrEnum):
    """Whether a host took the chunk: the one rule every scheduler of plain runs follows."""

    UNREACHED = "unreached"
    """No host took it (no connection; no answer head over HTTP/1.1; a host's or a gateway's
    "not now"): send it again, elsewhere if need be."""
    TAKEN = "taken"
    """A host took it, or may have: never sent again (a second copy would run it twice)."""
    REFUSED = "refused"
    """Refused for what it is (too large, invalid): no send anywhere can succeed."""


class RolloutError(Exception):
    """A chunk (or a whole batch) failed; ``origin`` says where to look, ``reach`` whether a
    host took it, ``suspect`` that the host may be gone (a scheduler probes it before sending it
    more)."""

    def __init__(
        self,
        message: str,
        *,
        origin: Origin,
        reach: Reach,
        suspect: bool = False,
        status: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.origin = origin
        self.reach = reach
        self.suspect = suspect
        self.status = status
        self.code = code

    def renamed(self, message: str, *, reach: Reach | None = None) -> RolloutError:
        """The same failure under a message that says more (which chunk, which host)."""
        return RolloutError(
            message,
            origin=self.origin,
            reach=self.reach if reach is None else reach,
            suspect=self.suspect,
            status=self.status,
            code=self.code,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Survives pickling across worker processes with its attributes intact.
        return (
            _rebuild_error,
            (
                type(self),
                self.message,
                self.origin,
                self.reach,
                self.suspect,
                self.status,
                self.code,
            ),
        )

    def __str__(self) -> str:
        return f"[{self.origin.value}] {self.message}"


def _rebuild_error(
    cls: type[RolloutError],
    message: str,
    origin: Origin,
    reach: Reach,
    suspect: bool,
    status: int | None,
    code: str | None,
) -> RolloutError:
    return cls(message, origin=origin, reach=reach, suspect=suspect, status=status, code=code)
