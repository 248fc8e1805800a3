"""The checkpoint control plane's vocabulary (DESIGN §3.4): its paths, the participant every
host exports, and the request and reply shapes both sides speak.

Requests are pydantic models, strict and closed (``extra="forbid"``): the host validates every
call against them, and the trainer builds its calls from them, so a field is named in one place.
Replies are modelled where the trainer relies on their shape; NOTES.md lists them all.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field

from .export import ManifestParticipant

PREFIX: Final = "/control/v1/checkpoint/"
MAX_LEASE_S: Final = 3600.0  # a lease (and the wait a prepare adds to it) is at most an hour
HOST_PARTICIPANT: Final = ("host", "episodes")
"""Every host's own participant: its episodes' boundary states, one record each."""

CheckpointId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")]
Seconds = Annotated[float, Field(gt=0, le=MAX_LEASE_S, allow_inf_nan=False)]


def path(operation: str) -> str:
    """The path of a control operation (``status``, ``prepare``, ...)."""
    return f"{PREFIX}{operation}"


class Call(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    checkpoint_id: CheckpointId
    deadline: Annotated[float, Field(allow_inf_nan=False)]
    """Absolute, seconds since the epoch: two machines agree on it."""


class Prepare(Call):
    lease_s: Seconds = 60.0


class Renew(Call):
    lease_s: Seconds = 60.0


class Commit(Call):
    directory: str
    capture_keys: list[str] | None = None


class Resume(Call):
    pass


class Restore(Call):
    directory: str
    capture_keys: list[str] | None = None
    lease_s: Seconds = 60.0


class RetireRollout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    rollout_id: Annotated[str, Field(min_length=1)]
    attempt: Annotated[int, Field(ge=0)]


class Retire(Call):
    rollouts: list[RetireRollout]


class Forget(Call):
    rollout_ids: list[str] | None = None


REQUESTS: Final[dict[str, type[Call]]] = {
    "prepare": Prepare,
    "renew": Renew,
    "commit": Commit,
    "resume": Resume,
    "restore": Restore,
    "retire": Retire,
    "forget": Forget,
}
"""Every ``POST`` operation and its request (``status`` is a ``GET`` with none)."""


class CommittedParticipant(ManifestParticipant):
    """A participant as a commit reply names it: its state where the host wrote it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    state_directory: str = Field(min_length=1)
    capture_keys: list[str]


class CommitReply(BaseModel):
    """What a commit reply holds that the trainer relies on (other fields may follow)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    capture_keys: list[str]
    participants: list[CommittedParticipant]
