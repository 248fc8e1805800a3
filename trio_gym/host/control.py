"""``/control/v1/checkpoint/...``: the checkpoint control plane over HTTP.

Bearer-token protected (``control_token`` / ``NMP_CONTROL_TOKEN``; without one configured the
control plane is off and its paths are 404). ``GET .../status``; every other operation is a
``POST`` of a JSON object with ``checkpoint_id`` and ``deadline`` (an absolute time, seconds
since the epoch), answered with a JSON object. The request and reply shapes are listed in
NOTES.md; refusals use the error envelope (401, 400, 409 ``stale_checkpoint`` /
``checkpoint_conflict`` / ``wrong_phase``, 422 ``export_invalid``, 504 ``deadline_exceeded``).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import pydantic
import trio

from trio_gym.errors import ErrorCode, WireError, describe_validation_error, shown
from trio_gym.http import HttpConnection, read_body, send_json
from trio_gym.http.h11_build import h11
from trio_gym.protocol.control import (
    COMMIT,
    FORGET,
    PREPARE,
    RENEW,
    RESTORE,
    RESUME,
    RETIRE,
    Commit,
    Forget,
    Operation,
    Prepare,
    Renew,
    Reply,
    Restore,
    Resume,
    Retire,
)

from .state import Services

MAX_CONTROL_BODY: Final = 1024 * 1024


def _absolute(directory: str) -> Path:
    path = Path(directory)
    if not path.is_absolute():
        raise WireError(
            ErrorCode.INVALID_REQUEST, f"directory {shown(directory.encode())} must be absolute"
        )
    return path


async def _prepare(services: Services, call: Prepare) -> Reply:
    return await services.checkpoints.prepare(call.checkpoint_id, call.deadline, call.lease_s)


async def _renew(services: Services, call: Renew) -> Reply:
    return services.checkpoints.renew(call.checkpoint_id, call.lease_s)


async def _commit(services: Services, call: Commit) -> Reply:
    directory = _absolute(call.directory)
    return await services.checkpoints.commit(
        call.checkpoint_id, call.deadline, directory, call.capture_keys
    )


async def _resume(services: Services, call: Resume) -> Reply:
    return services.checkpoints.resume(call.checkpoint_id)


async def _restore(services: Services, call: Restore) -> Reply:
    directory = _absolute(call.directory)
    return services.checkpoints.restore(
        call.checkpoint_id, directory, call.capture_keys, call.lease_s
    )


async def _retire(services: Services, call: Retire) -> Reply:
    rollouts = [(rollout.rollout_id, rollout.attempt) for rollout in call.rollouts]
    return await services.checkpoints.retire(call.checkpoint_id, call.deadline, rollouts)


async def _forget(services: Services, call: Forget) -> Reply:
    return services.checkpoints.forget(call.checkpoint_id, call.rollout_ids)


# What carries out each POST operation of the protocol's table (status is answer_status); the
# server routes exactly these, each to answer_operation bound to its operation.
CARRY_OUT: Final[dict[Operation[Any, Any], Callable[[Services, Any], Awaitable[Reply]]]] = {
    PREPARE: _prepare,
    RENEW: _renew,
    COMMIT: _commit,
    RESUME: _resume,
    RESTORE: _restore,
    RETIRE: _retire,
    FORGET: _forget,
}


def _authorize(services: Services, head: h11.Request) -> None:
    token = services.config.control_token
    if not token:
        raise WireError(
            ErrorCode.NOT_FOUND,
            "the checkpoint control plane is off; set NMP_CONTROL_TOKEN to turn it on",
        )
    given = b""
    for name, value in head.headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            given = value[7:].strip()
    if not hmac.compare_digest(given, token.encode()):
        raise WireError(
            ErrorCode.UNAUTHORIZED,
            "the control plane needs 'Authorization: Bearer <NMP_CONTROL_TOKEN>'",
            headers=[("www-authenticate", "Bearer")],
        )


async def answer_status(services: Services, conn: HttpConnection, head: h11.Request) -> None:
    _authorize(services, head)
    await send_json(conn, 200, services.checkpoints.status().model_dump(mode="json"))


async def answer_operation(
    operation: Operation[Any, Any], services: Services, conn: HttpConnection, head: h11.Request
) -> None:
    """Answer a POST of ``operation`` (the route binds it). A stopping host (it still listens
    while its batches answer) starts nothing new: only a resume, which lets go, is carried out."""
    _authorize(services, head)
    if services.lifecycle.shutdown_requested.is_set() and operation is not RESUME:
        raise WireError(
            ErrorCode.SHUTTING_DOWN,
            f"the host is shutting down: no {operation.name} now; its provider is replacing it",
        )
    name = operation.name
    body = await read_body(
        conn, head, max_bytes=MAX_CONTROL_BODY, idle_timeout_s=services.limits.read_timeout_s
    )
    try:
        call = operation.request.model_validate(json.loads(body))
    except (ValueError, RecursionError) as exc:
        detail = (
            describe_validation_error(exc) if isinstance(exc, pydantic.ValidationError) else exc
        )
        raise WireError(ErrorCode.INVALID_REQUEST, f"{name}: {detail}") from exc
    if call.deadline <= services.checkpoints.wall(trio.current_time()):
        raise WireError(
            ErrorCode.DEADLINE_EXCEEDED,
            f"{name}: its deadline had passed when it arrived; check the clocks or the timeout",
        )
    reply = await CARRY_OUT[operation](services, call)
    await send_json(conn, 200, reply.model_dump(mode="json"))
