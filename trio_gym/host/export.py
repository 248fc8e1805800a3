"""Writing a checkpoint export (its form, and how it is read back: :mod:`trio_gym.protocol.export`).

Each participant's records go to a file named by the SHA-256 of its content, written whole and
durably (:func:`trio_gym.files.write_whole`); the manifest last, staged and fsynced, then
linked into place once.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trio_gym.errors import ErrorCode, WireError
from trio_gym.files import write_whole
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


def staging_path(directory: Path) -> Path:
    """Where a manifest is staged before it is published: a fresh hidden name beside it."""
    return directory / f".{MANIFEST}.{secrets.token_hex(8)}"


def stage_manifest(staged: Path, manifest: Mapping[str, Any]) -> None:
    """Write the manifest's bytes to ``staged``, fsynced: the slow half of publishing (a
    worker thread's). Nothing reads it until :func:`publish_manifest` links it in place."""
    descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(descriptor, "wb") as file:
        file.write(json.dumps(manifest, indent=2, sort_keys=True).encode())
        file.flush()
        os.fsync(file.fileno())


def publish_manifest(directory: Path, staged: Path) -> Path:
    """Create the manifest from a staged one, once: a hard link, so it appears whole and is
    never replaced. The same content again is accepted (a retried commit); different content
    for an existing manifest is ``checkpoint_conflict``. No fsync: it is durable once
    ``directory`` is fsynced (:func:`trio_gym.files.fsync_directory`)."""
    path = directory / MANIFEST
    try:
        os.link(staged, path)
    except FileExistsError:
        if path.read_bytes() == staged.read_bytes():
            return path
        raise WireError(
            ErrorCode.CHECKPOINT_CONFLICT,
            f"{path} already holds a different export; commit to a fresh directory",
        ) from None
    return path
