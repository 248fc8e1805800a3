"""How the trainer names a failure: :class:`RolloutError` with its ``origin`` (DESIGN §5; which
answer is which origin is :mod:`trio_gym.trainer.answers`)."""

from __future__ import annotations

import enum
from typing import Any


class Origin(enum.StrEnum):
    SANDBOX = "sandbox"
    PROXY = "proxy"
    CLIENT = "client"


class RolloutError(Exception):
    """A chunk (or a whole batch) failed; ``origin`` says where to look."""

    def __init__(
        self,
        message: str,
        *,
        origin: Origin,
        retryable: bool,
        status: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.origin = origin
        self.retryable = retryable
        self.status = status
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        # Survives pickling across worker processes with its attributes intact.
        return (
            _rebuild_error,
            (type(self), self.message, self.origin, self.retryable, self.status, self.code),
        )

    def __str__(self) -> str:
        return f"[{self.origin.value}] {self.message}"


def _rebuild_error(
    cls: type[RolloutError],
    message: str,
    origin: Origin,
    retryable: bool,
    status: int | None,
    code: str | None,
) -> RolloutError:
    return cls(message, origin=origin, retryable=retryable, status=status, code=code)
