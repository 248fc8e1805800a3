"""Finding other processes by an environment variable they inherited, for tests that must show
a process tree is gone (their ends cannot be awaited from here: they are not our children)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def processes_with(variable: str, value: str) -> list[int]:
    """Every live (not zombie) process whose environment has ``variable=value``."""
    marker = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if marker in environ and state != "Z":
            found.append(int(entry.name))
    return found


def kill_all(variable: str, value: str) -> None:
    """SIGKILL whatever carries ``variable=value``: a failed test's leftovers."""
    for pid in processes_with(variable, value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
