"""Calling a host's checkpoint control plane from a trio program.

Every call carries an absolute ``deadline`` (wall-clock seconds, so that two machines agree on
it) computed from ``timeout_s``, and is itself bounded by that timeout plus a short grace for
the reply: a host that never answers is a :class:`ControlTimeout`, and the call is cancelled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import trio
from pydantic import BaseModel, ValidationError

from trio_gym.errors import describe_validation_error, quote_body
from trio_gym.http import (
    BodyFailed,
    Endpoint,
    HttpLimits,
    NoResponse,
    StreamOpener,
    encode_json,
    exchange,
    open_tcp,
)
from trio_gym.protocol.control import (
    COMMIT,
    FORGET,
    PREPARE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    STATUS,
    CommitReply,
    ForgetReply,
    Operation,
    PrepareReply,
    RenewReply,
    Reply,
    RestoreReply,
    ResumeReply,
    RetireReply,
    RetireRollout,
    Status,
    StatusReply,
)
from trio_gym.protocol.rollouts import JSON_MEDIA

REPLY_GRACE_S: Final = 5.0

Q = TypeVar("Q", bound=BaseModel)
R = TypeVar("R", bound=Reply)


class ControlError(Exception):
    """The host refused a control call; ``code`` is its error code (``checkpoint_conflict``...)."""

    def __init__(self, message: str, *, code: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.code, self.status))

    def __str__(self) -> str:
        if not self.status:  # no reply at all: the message says what happened
            return self.message
        return f"HTTP {self.status} {self.code}: {self.message}"


class ControlTimeout(ControlError):
    """No reply within the call's deadline plus the reply grace (or no connection at all)."""


class ReplyMismatch(ControlError):
    """The host answered, but not with the reply the protocol gives that operation."""


def _rebuild(kind: type[ControlError], message: str, code: str, status: int) -> ControlError:
    """Unpickle a control error as its own class (it crosses process boundaries to trainers'
    workers)."""
    return kind(message, code=code, status=status)


class HostControl:
    """The control plane of one host: ``await control.prepare("ckpt-7", timeout_s=30)``, or
    any operation of the protocol's table as ``await control.call(PREPARE, request, ...)``.
    Every reply comes back as the protocol's model of it; one that does not fit is a
    :class:`ReplyMismatch` naming ``name`` (the host's URL unless given), the operation and
    every field that does not fit. ``headers`` go with every call (a platform's proxy's, the
    host's identity: a launched host's ``HostHandle.request_headers()``)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        name: str = "",
        headers: Sequence[tuple[str, str]] = (),
        limits: HttpLimits | None = None,
        opener: StreamOpener = open_tcp,
        wall_time: Callable[[], float] = time.time,  # clock-ok: deadlines cross machines
        reply_grace_s: float = REPLY_GRACE_S,
    ) -> None:
        self.endpoint = Endpoint.parse(url)
        self.name = name or url
        self._headers = tuple(headers)
        self._token = token
        self._limits = limits or HttpLimits()
        self._opener = opener
        self._wall_time = wall_time
        self._grace = reply_grace_s

    async def status(self, *, timeout_s: float = 30.0) -> StatusReply:
        return await self.call(STATUS, Status(), timeout_s=timeout_s)

    async def prepare(
        self, checkpoint_id: str, *, timeout_s: float, lease_s: float = 60.0
    ) -> PrepareReply:
        return await self._op(PREPARE, checkpoint_id, timeout_s, lease_s=lease_s)

    async def renew(
        self, checkpoint_id: str, *, timeout_s: float, lease_s: float = 60.0
    ) -> RenewReply:
        return await self._op(RENEW, checkpoint_id, timeout_s, lease_s=lease_s)

    async def commit(
        self,
        checkpoint_id: str,
        directory: str,
        *,
        timeout_s: float,
        capture_keys: Sequence[str] | None = None,
    ) -> CommitReply:
        keys = list(capture_keys) if capture_keys is not None else None
        return await self._op(
            COMMIT, checkpoint_id, timeout_s, directory=directory, capture_keys=keys
        )

    async def resume(self, checkpoint_id: str, *, timeout_s: float) -> ResumeReply:
        return await self._op(RESUME, checkpoint_id, timeout_s)

    async def restore(
        self,
        checkpoint_id: str,
        directory: str,
        *,
        timeout_s: float,
        capture_keys: Sequence[str] | None = None,
        lease_s: float = 60.0,
    ) -> RestoreReply:
        keys = list(capture_keys) if capture_keys is not None else None
        return await self._op(
            RESTORE,
            checkpoint_id,
            timeout_s,
            directory=directory,
            capture_keys=keys,
            lease_s=lease_s,
        )

    async def retire(
        self, checkpoint_id: str, rollouts: Sequence[tuple[str, int]], *, timeout_s: float
    ) -> RetireReply:
        listed = [RetireRollout.model_construct(rollout_id=r, attempt=a) for r, a in rollouts]
        return await self._op(RETIRE, checkpoint_id, timeout_s, rollouts=listed)

    async def forget(
        self, checkpoint_id: str, rollout_ids: Sequence[str] | None = None, *, timeout_s: float
    ) -> ForgetReply:
        ids = list(rollout_ids) if rollout_ids is not None else None
        return await self._op(FORGET, checkpoint_id, timeout_s, rollout_ids=ids)

    async def _op(
        self, operation: Operation[Q, R], checkpoint_id: str, timeout_s: float, **fields: Any
    ) -> R:
        # Built from the protocol's request model, unvalidated: what the host makes of the
        # values (a lease too long, say) is its answer to give, as a refusal.
        request = operation.request.model_construct(
            checkpoint_id=checkpoint_id, deadline=self._wall_time() + timeout_s, **fields
        )
        return await self.call(operation, request, timeout_s=timeout_s)

    async def call(self, operation: Operation[Q, R], request: Q, *, timeout_s: float) -> R:
        """Send ``request`` as ``operation`` and read the reply as its model, within
        ``timeout_s`` and the reply grace (a POST's request carries its own deadline too)."""
        document = await self._exchange(operation, request, timeout_s)
        try:
            return operation.reply.model_validate(document)
        except ValidationError as exc:
            raise ReplyMismatch(
                f"{self.name}'s {operation.name} reply does not fit the contract: "
                f"{describe_validation_error(exc)}",
                code="bad_reply",
                status=200,
            ) from exc

    async def _exchange(self, operation: Operation[Q, R], request: Q, timeout_s: float) -> Any:
        name = operation.name
        payload = encode_json(request.model_dump()) if operation.method == "POST" else b""
        with trio.move_on_after(timeout_s + self._grace):
            try:
                response = await exchange(
                    self.endpoint,
                    operation.method,
                    operation.path,
                    payload,
                    limits=self._limits,
                    max_response_bytes=64 * 1024 * 1024,
                    idle_timeout_s=timeout_s + self._grace,
                    headers=[
                        ("authorization", f"Bearer {self._token}"),
                        ("content-type", JSON_MEDIA),
                        *self._headers,
                    ],
                    opener=self._opener,
                )
            except (NoResponse, BodyFailed) as exc:
                raise ControlTimeout(f"{name}: {exc}", code="unreachable", status=0) from exc
            try:
                document = json.loads(response.body)
            except ValueError as exc:
                raise ControlError(
                    f"{name}: the host answered HTTP {response.status} with a body that is not "
                    f"JSON: {quote_body(response.body)}",
                    code="bad_reply",
                    status=response.status,
                ) from exc
            if response.status != 200:
                error = document.get("error", {}) if isinstance(document, dict) else {}
                raise ControlError(  # the host's message names the operation itself
                    str(error.get("message", response.body[:200])),
                    code=str(error.get("code", "unknown")),
                    status=response.status,
                )
            return document
        raise ControlTimeout(
            f"{name}: no reply from {self.endpoint.authority} within {timeout_s:g} s + "
            f"{self._grace:g} s grace; the call was cancelled",
            code="timeout",
            status=0,
        )
