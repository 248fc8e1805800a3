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

from trio_gym.errors import ErrorCode, WireError, describe_validation_error
from trio_gym.http import HttpConnection, read_body, send_json
from trio_gym.http.h11_build import h11
from trio_gym.protocol.control import (
    REQUESTS,
    Commit,
    Forget,
    Prepare,
    Renew,
    Reply,
    Restore,
    Resume,
    Retire,
    path,
)

from .state import Host

MAX_CONTROL_BODY: Final = 1024 * 1024


def _absolute(directory: str) -> Path:
    path = Path(directory)
    if not path.is_absolute():
        raise WireError(ErrorCode.INVALID_REQUEST, f"directory {directory!r} must be absolute")
    return path


async def _prepare(host: Host, call: Prepare) -> Reply:
    return await host.checkpoints.prepare(call.checkpoint_id, call.deadline, call.lease_s)


async def _renew(host: Host, call: Renew) -> Reply:
    return host.checkpoints.renew(call.checkpoint_id, call.lease_s)


async def _commit(host: Host, call: Commit) -> Reply:
    directory = _absolute(call.directory)
    return await host.checkpoints.commit(
        call.checkpoint_id, call.deadline, directory, call.capture_keys
    )


async def _resume(host: Host, call: Resume) -> Reply:
    return host.checkpoints.resume(call.checkpoint_id)


async def _restore(host: Host, call: Restore) -> Reply:
    directory = _absolute(call.directory)
    return host.checkpoints.restore(call.checkpoint_id, directory, call.capture_keys, call.lease_s)


async def _retire(host: Host, call: Retire) -> Reply:
    rollouts = [(rollout.rollout_id, rollout.attempt) for rollout in call.rollouts]
    return await host.checkpoints.retire(call.checkpoint_id, call.deadline, rollouts)


async def _forget(host: Host, call: Forget) -> Reply:
    return host.checkpoints.forget(call.checkpoint_id, call.rollout_ids)


Operation = Callable[[Host, Any], Awaitable[Reply]]
OPERATIONS: Final[dict[str, Operation]] = {
    "prepare": _prepare,
    "renew": _renew,
    "commit": _commit,
    "resume": _resume,
    "restore": _restore,
    "retire": _retire,
    "forget": _forget,
}


def control_paths() -> list[str]:
    return [path("status"), *(path(name) for name in OPERATIONS)]


def _authorize(host: Host, head: h11.Request) -> None:
    token = host.config.control_token
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


async def answer_status(host: Host, conn: HttpConnection, head: h11.Request) -> None:
    _authorize(host, head)
    await send_json(conn, 200, host.checkpoints.status().model_dump(mode="json"))


async def answer_operation(host: Host, conn: HttpConnection, head: h11.Request) -> None:
    _authorize(host, head)
    name = head.target.decode("ascii", "replace").partition("?")[0].rsplit("/", 1)[-1]
    model, operation = REQUESTS[name], OPERATIONS[name]
    body = await read_body(
        conn, head, max_bytes=MAX_CONTROL_BODY, idle_timeout_s=host.limits.read_timeout_s
    )
    try:
        call = model.model_validate(json.loads(body))
    except (ValueError, RecursionError) as exc:
        detail = (
            describe_validation_error(exc) if isinstance(exc, pydantic.ValidationError) else exc
        )
        raise WireError(ErrorCode.INVALID_REQUEST, f"{name}: {detail}") from exc
    if call.deadline <= host.checkpoints.wall(trio.current_time()):
        raise WireError(
            ErrorCode.DEADLINE_EXCEEDED,
            f"{name}: its deadline had passed when it arrived; check the clocks or the timeout",
        )
    reply = await operation(host, call)
    await send_json(conn, 200, reply.model_dump(mode="json"))
