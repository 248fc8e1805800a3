"""Other processes a test starts or watches: ``trio-gym serve`` as a subprocess with its JSON
log read event by event, and processes found by an environment variable they inherited, for
tests that must show a process tree is gone (their ends cannot be awaited from here: they are
not our children)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

HANG_GUARD_S = 60


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


class LogReader:
    """Reads a subprocess's JSON-lines stderr, one event at a time."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.events: list[dict[str, Any]] = []

    async def next_event(self) -> dict[str, Any] | None:
        while b"\n" not in self.buffer:
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        event: dict[str, Any] = json.loads(line)
        self.events.append(event)
        return event

    async def wait_for(self, name: str) -> dict[str, Any]:
        while True:
            event = await self.next_event()
            assert event is not None, f"stderr ended before {name!r}: {self.events}"
            if event["event"] == name:
                return event


@asynccontextmanager
async def serve_process(
    *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[tuple[trio.Process, LogReader, int]]:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_gym", "serve", "--port", "0", *args],
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        assert process.stderr is not None
        logs = LogReader(process.stderr)
        with trio.fail_after(HANG_GUARD_S):
            port = (await logs.wait_for("listening"))["port"]
            await logs.wait_for("ready")
        yield process, logs, port
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def run_trio_gym(*args: str) -> trio.CompletedProcess[bytes]:
    """``python -m trio_gym ARGS`` to its end, its output captured."""
    with trio.fail_after(HANG_GUARD_S):
        return await trio.run_process(
            [sys.executable, "-m", "trio_gym", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


def write_examples(path: Path, examples: list[Any]) -> Path:
    """``examples`` as a JSON-lines file at ``path``."""
    path.write_text("".join(json.dumps(example) + "\n" for example in examples))
    return path
