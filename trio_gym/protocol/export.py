"""The on-disk form of a checkpoint export, and how it is read back and verified (by a host's
restore and by a trainer's); the host writes it (:mod:`trio_gym.host.export`), so that nothing
half-written is restorable.

::

    <directory>/
      participants/<kind>/<server_name>/<sha256>.jsonl   one JSON record per line
      manifest.json                                      written last, created once

Each participant's records go to a file named by the SHA-256 of its content, written to a
temporary name, flushed to disk and renamed. The manifest is written last, with ``O_EXCL``:
created once, never replaced. A crash before it leaves no manifest, and an export without a
manifest is refused by restore. Reading verifies every file's digest and record count against
the manifest before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import attrs
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from trio_gym.errors import ErrorCode, WireError, describe_validation_error

FORMAT: Final = "trio-gym-export-v1"  # also ManifestHead.format
MANIFEST: Final = "manifest.json"


@attrs.frozen
class ParticipantExport:
    """One participant's part of an export, as the manifest and the commit reply name it."""

    server_name: str
    kind: str
    state_directory: str
    records_file: str
    sha256: str
    record_count: int
    capture_keys: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "capture_keys": list(self.capture_keys)}


PathPart = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*$", max_length=200)]
"""A directory or file name from a manifest: one path component, never ``..``."""


class ManifestParticipant(BaseModel):
    """A participant as a manifest lists it (what restore relies on; more fields may follow)."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    server_name: PathPart
    kind: PathPart
    records_file: Annotated[str, Field(pattern=r"^[0-9a-f]{64}\.jsonl$")]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    record_count: Annotated[int, Field(ge=0)]


class ManifestHead(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    format: Literal["trio-gym-export-v1"]
    checkpoint_id: str
    participants: Annotated[list[ManifestParticipant], Field(min_length=1)]


def invalid(message: str) -> WireError:
    return WireError(ErrorCode.EXPORT_INVALID, message)


@attrs.frozen
class Export:
    manifest: Mapping[str, Any]
    records: Mapping[tuple[str, str], list[dict[str, Any]]]
    """(server name, kind) -> that participant's verified records."""


def read_export(directory: Path) -> Export:
    """Read and verify an export; raises ``export_invalid`` naming the file at fault."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise invalid(
            f"{path} does not exist: the export was never completed (or is elsewhere)"
        ) from None
    except (OSError, ValueError) as exc:
        raise invalid(f"{path} cannot be read as JSON: {exc}") from exc
    try:
        head = ManifestHead.model_validate(manifest)
    except pydantic.ValidationError as exc:
        raise invalid(
            f"{path} is not a complete {FORMAT} manifest (it must list its participants): "
            f"{describe_validation_error(exc)}"
        ) from exc
    records: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for entry in head.participants:
        if (entry.server_name, entry.kind) in records:
            raise invalid(f"{path} lists participant {entry.kind}/{entry.server_name} twice")
        records[(entry.server_name, entry.kind)] = _verified(directory, entry)
    return Export(manifest, records)


def _verified(directory: Path, entry: ManifestParticipant) -> list[dict[str, Any]]:
    file = directory / "participants" / entry.kind / entry.server_name / entry.records_file
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise invalid(f"{file}: cannot be read ({exc.strerror})") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise invalid(f"{file}: its SHA-256 is {digest}, the manifest says {entry.sha256}")
    try:
        lines = [json.loads(line) for line in data.splitlines() if line.strip()]
    except ValueError as exc:
        raise invalid(f"{file}: a line is not JSON ({exc})") from exc
    if len(lines) != entry.record_count:
        raise invalid(f"{file}: holds {len(lines)} records, the manifest says {entry.record_count}")
    if not all(
        isinstance(line, dict) and isinstance(line.get("capture_key"), str) for line in lines
    ):
        raise invalid(f"{file}: every record must be a JSON object with a string capture_key")
    return lines
