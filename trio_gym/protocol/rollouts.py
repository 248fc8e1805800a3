"""The rollouts half of the wire: its paths and media types, what ``POST /rollouts/run``
carries (:class:`RolloutRequest`, which the host validates and the trainer builds), and how a
failed example comes back: as a *failure record*, the shape NeMo Gym's collection writes to its
``<stem>_failures.jsonl``. Error codes are :class:`trio_gym.errors.ErrorCode`, one enum both
sides read.

- ``"failures": "records"`` in the request: a failed example's failure record takes its place in
  the document's ``results`` (``"batch"``, the default, keeps the upstream host's behaviour: one
  failed example fails the batch ``internal``). A row stream's sidecar row always carries the
  record beside its error, under ``"record"``.
- ``"row_offset": N``: the position of the request's first example in the caller's whole input.
  A runner that numbers rows as Gym's collection does (a task index from the row's position)
  numbers from there, so the chunks of one input never share a number.

A failure record is an object with ``_ng_failure_class``. Gym's classes come from Gym (its
failure record, or the class its collection gives a failed ``/run``); the host adds
:data:`RUNNER_ERROR` (a runner raised), :data:`STALE_ATTEMPT` (the control plane retired the
attempt), and the trainer :data:`REQUEST_FAILED` (a chunk the host never answered). Every
failure record names its row as Gym's collection numbers rows (:func:`failure_identity`), so a
trainer can tell which input line failed.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from trio_gym.errors import ErrorCode

from .identity import IDENTITY_KEYS, ROLLOUT_KEY, TASK_KEY, numbered

RUN_PATH: Final = "/rollouts/run"
HEALTH_PATH: Final = "/health"
METRICS_PATH: Final = "/metrics"
"""Prometheus text: a host's, and ``trio-gym run --metrics-port``'s."""
JSON_MEDIA: Final = "application/json"
NDJSON_MEDIA: Final = "application/x-ndjson"
"""What ``Accept`` asks for to have the answer row by row, one JSON line per finished example."""

FailureMode = Literal["batch", "records"]


class RolloutRequest(BaseModel):
    """The body of ``POST /rollouts/run``: ``{"examples": [...]}``, and optionally
    ``"deadline_s"``, ``"failures"`` and ``"row_offset"`` (this module's docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    examples: list[dict[str, Any]]
    deadline_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    failures: FailureMode = "batch"
    row_offset: Annotated[int, Field(ge=0)] = 0

    def wire_fields(self) -> dict[str, Any]:
        """The fields it was built with, as they are: what a sender encodes (the examples are
        not copied, and a field left at its default is not sent)."""
        chosen = self.model_fields_set  # a set: keep the model's order, so the bytes are fixed
        return {name: getattr(self, name) for name in type(self).model_fields if name in chosen}


IDEMPOTENCY_KEY_HEADER: Final = "idempotency-key"
"""A ``POST /rollouts/run`` under a key may be attached to again (:mod:`trio_gym.host.reattach`)."""


def new_idempotency_key() -> str:
    """A key for one request: a host that still has its batch attaches a second send to it."""
    return uuid.uuid4().hex


SIDECAR_RECORD_FIELD: Final = "record"

FAILURE_CLASS_KEY: Final = "_ng_failure_class"
FAILURE_TYPE_KEY: Final = "_ng_failure_type"
FAILURE_MESSAGE_KEY: Final = "_ng_failure_message"
FAILURE_STATUS_KEY: Final = "_ng_failure_http_status"
FAILURE_BODY_KEY: Final = "_ng_failure_response_body"

RUNNER_ERROR: Final = "runner_error"
STALE_ATTEMPT: Final = ErrorCode.STALE_ATTEMPT.value  # the class is the refusal's code
REQUEST_FAILED: Final = "host_request_failed"


# Copied from a row onto a failure record made for it, as Gym's collection copies them.
ROUTING_KEYS: Final = ("agent_ref", "_ng_environment_server")


def failure_identity(example: Mapping[str, Any], position: int) -> dict[str, Any]:
    """What a failure record made for ``example`` (at ``position`` in the caller's input) says
    of its row: its identity keys (numbered as Gym's collection numbers rows) and routing."""
    row = numbered(example, position)
    return {
        key: row[key]
        for key in (TASK_KEY, ROLLOUT_KEY, *IDENTITY_KEYS, *ROUTING_KEYS)
        if row.get(key) is not None
    }


def is_failure_record(result: Any) -> bool:
    """Whether a result is a failure record (it says how its example failed), not a result."""
    return isinstance(result, Mapping) and result.get(FAILURE_CLASS_KEY) is not None
