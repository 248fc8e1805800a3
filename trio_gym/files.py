"""Files written whole or not at all: the one way this project replaces a file another process
may read (a port file, results, an export's records, a checkpoint manifest)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_whole(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and a rename: a reader
    sees the old file or the new one, never a part. ``durable``: the data and the rename are
    fsynced too, so a crash of the machine leaves one of them (checkpoint files). The file gets
    the mode ``open()`` would have given it. Raises ``OSError``; no temporary file is left."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp's own is 0600
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)  # gone already once it was renamed
    if durable:
        fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename or a creation in ``directory`` durable (the entry, not just the data)."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
