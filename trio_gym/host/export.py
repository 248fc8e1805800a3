"""Writing a checkpoint export (its form, and how it is read back: :mod:`trio_gym.protocol.export`).

Each participant's records go to a file named by the SHA-256 of its content, written whole and
durably (:func:`trio_gym.files.write_whole`); the manifest last, created once.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trio_gym.errors import ErrorCode, WireError
from trio_gym.files import fsync_directory, write_whole
from trio_gym.http import encode_json
from trio_gym.protocol.export import MANIFEST, ParticipantExport


def write_records(
    directory: Path, server_name: str, kind: str, records: Sequence[Mapping[str, Any]]
) -> ParticipantExport:
    """Write one participant's records under their digest; return what the manifest lists."""
    data = b"".join(encode_json(record) + b"\n" for record in records)
    digest = hashlib.sha256(data).hexdigest()
    folder = directory / "participants" / kind / server_name
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{digest}.jsonl"
    write_whole(target, data, durable=True)
    keys = tuple(str(record["capture_key"]) for record in records)
    return ParticipantExport(
        server_name, kind, str(folder), target.name, digest, len(records), keys
    )


def publish_manifest(directory: Path, manifest: Mapping[str, Any]) -> Path:
    """Create the manifest once. The same content again is accepted (a retried commit);
    different content for an existing manifest is ``checkpoint_conflict``."""
    path = directory / MANIFEST
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if path.read_bytes() == data:
            return path
        raise WireError(
            ErrorCode.CHECKPOINT_CONFLICT,
            f"{path} already holds a different export; commit to a fresh directory",
        ) from None
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    fsync_directory(directory)
    return path
