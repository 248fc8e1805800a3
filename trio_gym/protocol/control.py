"""The checkpoint control plane's vocabulary: its paths, the participant every
host exports, and the request and reply shapes both sides speak.

Requests are pydantic models, strict and closed (``extra="forbid"``): the host validates every
call against them, and the trainer builds its calls from them, so a field is named in one place.
Replies are the models the host builds each answer from and the trainer reads it with; they are
strict but open (``extra="ignore"``), so a newer host may add a field without breaking an older
trainer.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Final, Generic, Literal, TypeVar

import attrs
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


class Status(BaseModel):
    """``status`` asks nothing: a ``GET`` with no body."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class CheckpointPhase(enum.StrEnum):
    """Where a host is in a checkpoint (the host's transition table is
    :mod:`trio_gym.host.checkpoint_phases`)."""

    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


class Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


PhaseField = Annotated[CheckpointPhase, Field(strict=False)]  # its name on the wire is a string
Admission = Literal["open", "closed"]


class Sample(Reply):
    """Capture keys too many to list: how many, and the first few by name."""

    count: Annotated[int, Field(ge=0)]
    sample: list[str]


class ParticipantName(Reply):
    server_name: str
    kind: str


class Counts(Reply):
    running: int
    parked: int
    restored: int
    retired: int


class StatusReply(Reply):
    phase: PhaseField
    participants: list[ParticipantName]
    checkpoint_id: str | None
    admission: Admission
    lease_expires_at: float | None
    counts: Counts


class PrepareReply(Reply):
    phase: PhaseField
    """``preparing`` while blockers remain (call again), ``prepared`` once none do."""
    checkpoint_id: str
    admission: Admission
    parked: Sample
    blockers: Sample
    restarts: Sample
    lease_expires_at: float


class RenewReply(Reply):
    phase: PhaseField
    checkpoint_id: str
    lease_expires_at: float


class CommittedParticipant(ManifestParticipant):
    """A participant as a commit reply names it: its state where the host wrote it."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    state_directory: str = Field(min_length=1)
    capture_keys: list[str]


class CommitReply(Reply):
    phase: PhaseField
    checkpoint_id: str
    directory: str
    manifest: str
    participants: list[CommittedParticipant]
    capture_keys: list[str]


class ResumeReply(Reply):
    phase: PhaseField
    checkpoint_id: str
    admission: Admission


class RestoredEpisodeName(Reply):
    rollout_id: str
    attempt: int
    capture_key: str
    step: int


class RestoreReply(Reply):
    phase: PhaseField
    checkpoint_id: str
    admission: Admission
    source_checkpoint_id: str | None
    restored: list[RestoredEpisodeName]


class RetireReply(Reply):
    checkpoint_id: str
    complete: bool
    """False while a retired episode is still stopping (call again); only a complete retire
    is remembered for replay."""
    retired: list[RetireRollout]
    stopped: int
    still_stopping: Sample


class ForgetReply(Reply):
    checkpoint_id: str
    forgotten: int


Q = TypeVar("Q", bound=BaseModel)
R = TypeVar("R", bound=Reply)


@attrs.frozen
class Operation(Generic[Q, R]):
    """One control operation: its name, the request it takes and the reply it gives."""

    name: str
    request: type[Q]
    reply: type[R]

    @property
    def path(self) -> str:
        return path(self.name)

    @property
    def method(self) -> str:
        return "GET" if self.request is Status else "POST"


STATUS: Final = Operation("status", Status, StatusReply)
PREPARE: Final = Operation("prepare", Prepare, PrepareReply)
RENEW: Final = Operation("renew", Renew, RenewReply)
COMMIT: Final = Operation("commit", Commit, CommitReply)
RESUME: Final = Operation("resume", Resume, ResumeReply)
RESTORE: Final = Operation("restore", Restore, RestoreReply)
RETIRE: Final = Operation("retire", Retire, RetireReply)
FORGET: Final = Operation("forget", Forget, ForgetReply)

OPERATIONS: Final[dict[str, Operation[Any, Any]]] = {
    operation.name: operation
    for operation in (STATUS, PREPARE, RENEW, COMMIT, RESUME, RESTORE, RETIRE, FORGET)
}
"""Every operation of the control plane, by name: the one table both sides work from."""
