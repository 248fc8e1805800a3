"""Calling a host's checkpoint control plane from a trio program.

Every call carries an absolute ``deadline`` (wall-clock seconds, so that two machines agree on
it) computed from ``timeout_s``, and is itself bounded by that timeout plus a short grace for
the reply: a host that never answers is a :class:`ControlTimeout`, and the call is cancelled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import trio
from pydantic import ValidationError

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
from trio_gym.protocol.control import REQUESTS, Reply, RetireRollout, path

REPLY_GRACE_S: Final = 5.0

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


def reply_as(model: type[R], document: Mapping[str, Any], operation: str, host: str) -> R:
    """``host``'s reply to ``operation`` read as the protocol's ``model`` of it.

    :class:`HostControl` hands back the JSON the host sent; a caller that acts on a reply reads
    it through here, so a reply that does not fit is one :class:`ReplyMismatch` naming the host,
    the operation and every field that does not fit, never a ``KeyError`` or a default."""
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        raise ReplyMismatch(
            f"{host}'s {operation} reply does not fit the contract: "
            f"{describe_validation_error(exc)}",
            code="bad_reply",
            status=200,
        ) from exc


class HostControl:
    """The control plane of one host: ``await control.prepare("ckpt-7", timeout_s=30)``.
    ``headers`` go with every call (a platform's proxy's, the host's identity: a launched
    host's ``HostHandle.request_headers()``)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        headers: Sequence[tuple[str, str]] = (),
        limits: HttpLimits | None = None,
        opener: StreamOpener = open_tcp,
        wall_time: Callable[[], float] = time.time,  # clock-ok: deadlines cross machines
        reply_grace_s: float = REPLY_GRACE_S,
    ) -> None:
        self.endpoint = Endpoint.parse(url)
        self._headers = tuple(headers)
        self._token = token
        self._limits = limits or HttpLimits()
        self._opener = opener
        self._wall_time = wall_time
        self._grace = reply_grace_s

    async def status(self, *, timeout_s: float = 30.0) -> dict[str, Any]:
        return await self._call("GET", "status", None, timeout_s)

    async def prepare(
        self, checkpoint_id: str, *, timeout_s: float, lease_s: float = 60.0
    ) -> dict[str, Any]:
        return await self._op("prepare", checkpoint_id, timeout_s, lease_s=lease_s)

    async def renew(
        self, checkpoint_id: str, *, timeout_s: float, lease_s: float = 60.0
    ) -> dict[str, Any]:
        return await self._op("renew", checkpoint_id, timeout_s, lease_s=lease_s)

    async def commit(
        self,
        checkpoint_id: str,
        directory: str,
        *,
        timeout_s: float,
        capture_keys: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        keys = list(capture_keys) if capture_keys is not None else None
        return await self._op(
            "commit", checkpoint_id, timeout_s, directory=directory, capture_keys=keys
        )

    async def resume(self, checkpoint_id: str, *, timeout_s: float) -> dict[str, Any]:
        return await self._op("resume", checkpoint_id, timeout_s)

    async def restore(
        self,
        checkpoint_id: str,
        directory: str,
        *,
        timeout_s: float,
        capture_keys: Sequence[str] | None = None,
        lease_s: float = 60.0,
    ) -> dict[str, Any]:
        keys = list(capture_keys) if capture_keys is not None else None
        return await self._op(
            "restore",
            checkpoint_id,
            timeout_s,
            directory=directory,
            capture_keys=keys,
            lease_s=lease_s,
        )

    async def retire(
        self, checkpoint_id: str, rollouts: Sequence[tuple[str, int]], *, timeout_s: float
    ) -> dict[str, Any]:
        listed = [RetireRollout.model_construct(rollout_id=r, attempt=a) for r, a in rollouts]
        return await self._op("retire", checkpoint_id, timeout_s, rollouts=listed)

    async def forget(
        self, checkpoint_id: str, rollout_ids: Sequence[str] | None = None, *, timeout_s: float
    ) -> dict[str, Any]:
        ids = list(rollout_ids) if rollout_ids is not None else None
        return await self._op("forget", checkpoint_id, timeout_s, rollout_ids=ids)

    async def _op(
        self, name: str, checkpoint_id: str, timeout_s: float, **fields: Any
    ) -> dict[str, Any]:
        # Built from the protocol's request model, unvalidated: what the host makes of the
        # values (a lease too long, say) is its answer to give, as a refusal.
        request = REQUESTS[name].model_construct(
            checkpoint_id=checkpoint_id, deadline=self._wall_time() + timeout_s, **fields
        )
        return await self._call("POST", name, request.model_dump(), timeout_s)

    async def _call(
        self, method: str, name: str, body: dict[str, Any] | None, timeout_s: float
    ) -> dict[str, Any]:
        payload = encode_json(body) if body is not None else b""
        with trio.move_on_after(timeout_s + self._grace):
            try:
                response = await exchange(
                    self.endpoint,
                    method,
                    path(name),
                    payload,
                    limits=self._limits,
                    max_response_bytes=64 * 1024 * 1024,
                    idle_timeout_s=timeout_s + self._grace,
                    headers=[
                        ("authorization", f"Bearer {self._token}"),
                        ("content-type", "application/json"),
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
            return document  # type: ignore[no-any-return]
        raise ControlTimeout(
            f"{name}: no reply from {self.endpoint.authority} within {timeout_s:g} s + "
            f"{self._grace:g} s grace; the call was cancelled",
            code="timeout",
            status=0,
        )
