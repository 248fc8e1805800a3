"""The trainer's checkpoint manifest, ``gym_checkpoint.json``: written last, atomically.

It names the checkpoint, holds the recovery ledger, and for each host instance the episodes it
exported (by capture key) and its participants — the state-holding parts whose exports must be
found on disk, unchanged, before anything is restored. Loading is strict: a manifest without
participant topology, or with anything it should not have, is refused with the reason, because
restoring from a manifest that cannot say where the state is would install nothing or the wrong
thing. Every path in it is relative to the checkpoint's own directory, and one that is absolute
or leads out of it is refused: trainers copy checkpoints to other storage and restore from
there.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from trio_gym.errors import describe_validation_error
from trio_gym.files import write_whole
from trio_gym.protocol.export import ManifestParticipant

MANIFEST_NAME: Final = "gym_checkpoint.json"
MANIFEST_FORMAT: Final = "trio-gym-trainer-checkpoint-v1"


class ManifestError(Exception):
    """A manifest that cannot be loaded as it is; the message says what is wrong."""


def _inside(path: str) -> str:
    """A path inside the checkpoint's directory: relative, and no way out of it."""
    parts = PurePosixPath(path).parts
    if not path or PurePosixPath(path).is_absolute() or ".." in parts or "\\" in path:
        raise ValueError(
            f"{path!r} is not a path inside the checkpoint (relative, without ..); a "
            "checkpoint records where its files are relative to itself, so it can move"
        )
    return path


InsidePath = Annotated[str, AfterValidator(_inside)]
"""Where something lives, relative to the checkpoint's directory (which may have moved)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Participant(ManifestParticipant):
    """A participant as the host's commit reply names it (the host's own checks on every
    field), and where its state lives; nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    state_directory: InsidePath


class HostExport(_Strict):
    instance: str = Field(min_length=1)
    """The host's name in the trainer (its dispatcher's host name): restored episodes go back
    to it and nowhere else."""
    directory: InsidePath
    """Where the host exported (its manifest and participants live under it), relative to
    the checkpoint's directory."""
    episodes: list[str]
    """Capture keys of the episodes this host exported (parked at a step boundary)."""
    participants: list[Participant] = Field(min_length=1)


class CheckpointManifest(_Strict):
    format: Literal["trio-gym-trainer-checkpoint-v1"]
    checkpoint_id: str = Field(min_length=1)
    ledger: dict[str, Any]
    trainer_state: dict[str, Any] = Field(default_factory=dict)
    """The trainer's own state in the same cut (what it consumed), saved with the ledger."""
    hosts: list[HostExport]


def write_manifest(directory: Path, manifest: CheckpointManifest) -> Path:
    """Write ``gym_checkpoint.json`` atomically: a temporary file, fsynced, renamed over, and
    the directory fsynced — a crash leaves the old manifest or the new one, never a mix."""
    path = directory / MANIFEST_NAME
    data = json.dumps(manifest.model_dump(), indent=1, sort_keys=True).encode()
    write_whole(path, data, durable=True)
    return path


def load_manifest(directory: Path) -> CheckpointManifest:
    path = directory / MANIFEST_NAME
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ManifestError(f"{path}: no checkpoint manifest here") from None
    except ValueError as exc:
        raise ManifestError(f"{path}: not JSON ({exc})") from exc
    try:
        manifest = CheckpointManifest.model_validate(document)
    except ValidationError as exc:
        raise ManifestError(f"{path}: {describe_validation_error(exc)}") from exc
    seen: dict[str, str] = {}
    for host in manifest.hosts:
        for key in host.episodes:
            if key in seen:
                raise ManifestError(
                    f"{path}: episode {key} is exported by both {seen[key]} and {host.instance}"
                )
            seen[key] = host.instance
    return manifest
