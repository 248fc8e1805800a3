"""Gym's record protocol, as nemo-gym 0.7.0's own rollout collection speaks it.

- A materialized taskset row (``task_id.taskset`` plus ``task_input``) is sent as an episode
  request ``{episode_id: {rollout_id, attempt}, task: {task_id, task_input}}``; the answer
  ``{episode_id, task_id, result | failure}`` becomes the record.
- Rows are numbered as Gym's collection numbers them before dispatch (:func:`numbered`): a row
  without ``_ng_task_index`` gets its position, without ``_ng_rollout_index`` 0, so its model
  calls are captured under a key.
- Records are stamped with ``agent_ref``, ``task_source``, ``skills_ref``, the task and rollout
  indices, ``_ng_rollout_id`` and ``_ng_attempt_index`` from the row that ran (when it has
  them), and ``_ng_environment_server`` and ``_ng_result_type`` (its implementation) for the
  environment server that ran it.
- A record carrying ``_ng_failure_class`` is Gym saying the rollout failed: not a result. A
  ``/run`` that fails (an HTTP error, a connection lost after the request went out, an answer
  that is not JSON) becomes the failure record Gym's collection writes for it
  (:func:`run_failure_record`): ``agent_run_error`` when a server answered with a status (it ran
  the rollout, and it broke), ``agent_request_failed`` when a gateway answered or nothing did.
- Gym's servers answer a failure with a JSON string, each hop wrapping its callee's body as a
  bytes literal; :func:`gym_error_text` reads that chain once.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any, Final

from trio_gym.errors import readable_body
from trio_gym.protocol.identity import (
    ATTEMPT_KEY,
    ROLLOUT_ID_KEY,
    ROLLOUT_KEY,
    TASK_KEY,
    attempt_of,
    rollout_id_of,
)
from trio_gym.protocol.rollouts import (
    FAILURE_BODY_KEY,
    FAILURE_CLASS_KEY,
    FAILURE_MESSAGE_KEY,
    FAILURE_STATUS_KEY,
    FAILURE_TYPE_KEY,
)
from trio_gym.runners.base import RecordedFailure

from .deployment import ENVIRONMENT_KEY, AgentError, Server

# Gym's record protocol (nemo-gym 0.7.0's rollout collection).
AGENT_REF_KEY: Final = "agent_ref"
ENVIRONMENT_SERVER_KEY: Final = "_ng_environment_server"
RESULT_TYPE_KEY: Final = "_ng_result_type"
FAILURE_TERMINAL_KEY: Final = "_ng_failure_terminal"
TASK_ID_KEY: Final = "_ng_task_id"
# Copied from the row onto its record, as Gym's collection copies them.
ROW_KEYS_ON_RECORDS: Final = (
    TASK_KEY,
    ROLLOUT_KEY,
    AGENT_REF_KEY,
    "task_source",
    "skills_ref",
    ATTEMPT_KEY,
    ROLLOUT_ID_KEY,
)
ENVIRONMENT_SERVER_FAILED: Final = "environment_server_failed"
# The classes Gym's collection gives a /run that failed: a server answered with a status (the
# rollout ran and broke), or a gateway answered or nothing did (nothing is known of it).
AGENT_RUN_ERROR: Final = "agent_run_error"
AGENT_REQUEST_FAILED: Final = "agent_request_failed"
# Statuses something in front of a Gym server answers with (Gym's servers answer 500 themselves).
GATEWAY_STATUSES: Final = frozenset({429, 502, 503, 504})
# How much of a failed /run's body its failure record keeps, as Gym's collection keeps it.
FAILURE_BODY_CHARS: Final = 2000

# Each Gym hop that fails wraps its callee's error body as a bytes literal after this phrase.
_INNER_ERROR: Final = re.compile(r"(?s)(.*?calling an inner server: )(b'.*'|b\".*\")")
# Past this, an error body is quoted as it is, not taken apart.
_UNWRAP_LIMIT: Final = 64 * 1024


class RunFailed(AgentError):
    """A row's ``/run`` failed: ``status`` is what a server answered (``None``: nothing did),
    ``body`` what it said, ``failure_type`` what went wrong, named for the failure record."""

    def __init__(
        self, message: str, *, failure_type: str, status: int | None = None, body: bytes = b""
    ) -> None:
        super().__init__(message)
        self.failure_type = failure_type
        self.status = status
        self.body = body


class RolloutFailed(AgentError, RecordedFailure):
    """The rollout failed: Gym answered so (``_ng_failure_class``), or its ``/run`` failed.
    ``record`` is the failure record; there is no result for this row."""


def run_failure_record(error: RunFailed) -> dict[str, Any]:
    """The failure record Gym's collection writes for a ``/run`` that failed (before the row's
    identity and routing are stamped on): its class by the status, the failure's type and
    message (trio_gym's: they name the server), the status and the start of the body."""
    ran = error.status is not None and error.status not in GATEWAY_STATUSES
    body = None
    if error.body:
        text = error.body[: FAILURE_BODY_CHARS * 4].decode("utf-8", "replace")
        body = text[:FAILURE_BODY_CHARS] + ("…" if len(error.body) > FAILURE_BODY_CHARS else "")
    return {
        FAILURE_CLASS_KEY: AGENT_RUN_ERROR if ran else AGENT_REQUEST_FAILED,
        FAILURE_TYPE_KEY: error.failure_type,
        FAILURE_MESSAGE_KEY: str(error),
        FAILURE_STATUS_KEY: error.status,
        FAILURE_BODY_KEY: body,
    }


def gym_error_text(body: bytes, limit: int = 1000) -> str:
    """A Gym server's error body, readable: a JSON string read once, and each inner server's
    body that Gym wrapped as a bytes literal (``calling an inner server: b'...'``) read in turn,
    so a model's error three hops down reads as itself instead of under layers of escapes."""
    text = readable_body(body[:_UNWRAP_LIMIT], limit=_UNWRAP_LIMIT)
    for _ in range(10):  # hops, at most
        wrapped = _INNER_ERROR.fullmatch(text)
        if wrapped is None:
            break
        try:
            inner = ast.literal_eval(wrapped.group(2))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            break
        if not isinstance(inner, bytes):
            break
        text = wrapped.group(1) + readable_body(inner, limit=_UNWRAP_LIMIT)
    if len(text) > limit or len(body) > _UNWRAP_LIMIT:
        return f"{text[:limit]} ... ({len(body)} bytes)"
    return text


def taskset_of(example: Mapping[str, Any]) -> str | None:
    """The taskset of a materialized task row (``task_id.taskset`` plus ``task_input``)."""
    task_id = example.get("task_id")
    if not isinstance(task_id, Mapping) or "task_input" not in example:
        return None
    taskset = task_id.get("taskset")
    return taskset if isinstance(taskset, str) and taskset else ""


def episode_request(row: Mapping[str, Any]) -> dict[str, Any]:
    """The body a taskset row is sent as: ``{episode_id: {rollout_id, attempt}, task}``.

    Raises ``ValueError`` for a row without an identity to name its episode by.
    """
    rollout_id = rollout_id_of(row)
    if rollout_id is None:
        raise ValueError(
            f"a taskset row needs {ROLLOUT_ID_KEY}, or {TASK_KEY} and {ROLLOUT_KEY}, to name "
            "its episode"
        )
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": attempt_of(row)},
        "task": {"task_id": row["task_id"], "task_input": row["task_input"]},
    }


def episode_record(response: Any) -> Any:
    """An environment server's episode answer as the record Gym's collection keeps: a
    ``failure`` becomes a failure record, a ``result`` is kept with ``_ng_task_id``. Anything
    else is returned as it came."""
    if not (
        isinstance(response, Mapping)
        and isinstance(response.get("episode_id"), Mapping)
        and ("result" in response or "failure" in response)
    ):
        return response
    task_id = response.get("task_id")
    failure = response.get("failure")
    if isinstance(failure, Mapping):
        return {
            TASK_ID_KEY: task_id,
            FAILURE_CLASS_KEY: ENVIRONMENT_SERVER_FAILED,
            FAILURE_TERMINAL_KEY: bool(failure.get("terminal", False)),
            FAILURE_MESSAGE_KEY: failure.get("failure_reason"),
        }
    result = response.get("result")
    if not isinstance(result, Mapping):
        raise AgentError(f"the episode answer for task {task_id!r} has no object result")
    return {**result, TASK_ID_KEY: task_id}


def stamp_record(row: Mapping[str, Any], record: Any, server: Server) -> Any:
    """The record with what Gym's collection copies onto every record (see the module
    docstring); a record that is not an object is left as it is."""
    if not isinstance(record, dict):
        return record
    stamped = {**record, **{key: row[key] for key in ROW_KEYS_ON_RECORDS if key in row}}
    if server.kind == ENVIRONMENT_KEY:
        stamped[ENVIRONMENT_SERVER_KEY] = server.name
        stamped[RESULT_TYPE_KEY] = server.implementation
    return stamped
