"""``trio-gym run``: a JSON-lines file of examples in, a JSON-lines file of results out."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import trio

from trio_gym.trainer.client import Progress
from trio_gym.trainer.errors import RolloutError
from trio_gym.trainer.hosts import LaunchFailed


class ExamplesFileError(ValueError):
    """The examples file cannot be used; the message names the line."""


def read_examples(path: Path) -> list[dict[str, Any]]:
    """One JSON object per line (blank lines skipped); raises :class:`ExamplesFileError`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ExamplesFileError(f"{path}: cannot read it as UTF-8 text ({exc})") from exc
    examples = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except ValueError as exc:
            raise ExamplesFileError(f"{path}:{number}: not JSON: {exc}") from exc
        if not isinstance(example, dict):
            raise ExamplesFileError(
                f"{path}:{number}: each line must be a JSON object, not {type(example).__name__}"
            )
        examples.append(example)
    if not examples:
        raise ExamplesFileError(f"{path}: no examples in it")
    return examples


class FileProgress:
    """Progress on stderr: examples done of the total, elapsed time, failures, retries."""

    def __init__(self, total: int, sizes: Sequence[int], out: TextIO) -> None:
        self.total = total
        self.sizes = sizes
        self.out = out
        self.done = 0
        self.failed = 0
        self.heartbeats = 0
        self.started = trio.current_time()

    def _show(self, note: str) -> None:
        elapsed = trio.current_time() - self.started
        print(
            f"[{elapsed:7.1f}s] {self.done}/{self.total} examples done, "
            f"{self.failed} chunk(s) failed, {self.heartbeats} heartbeat(s) - {note}",
            file=self.out,
            flush=True,
        )

    def chunk_started(self, chunk: int, attempt: int, size: int) -> None:
        if attempt > 1:
            self._show(f"chunk {chunk + 1}: attempt {attempt}")

    def heartbeat(self, chunk: int) -> None:
        self.heartbeats += 1

    def chunk_finished(self, chunk: int, results: Sequence[Any]) -> None:
        self.done += len(results)
        self._show(f"chunk {chunk + 1}/{len(self.sizes)} finished")

    def chunk_failed(self, chunk: int, error: RolloutError) -> None:
        self.failed += 1
        self._show(f"chunk {chunk + 1}/{len(self.sizes)} FAILED ({error.origin.value})")


def write_results(results: Sequence[Any], out: Path | None) -> None:
    """JSON lines, in input order; a file is written whole or not at all (temp + rename)."""
    lines = "".join(json.dumps(result) + "\n" for result in results)
    if out is None:
        sys.stdout.write(lines)
        sys.stdout.flush()
        return
    handle, temporary = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(lines)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # what open() would have given it, not mkstemp's 0600
        os.replace(temporary, out)
    finally:
        Path(temporary).unlink(missing_ok=True)  # gone already once it was renamed


BatchRunner = Callable[[Sequence[Mapping[str, Any]], Progress], Awaitable[list[Any]]]
"""Runs one batch on the hosts the command was given, telling ``progress`` as it goes."""


async def run_file(
    examples_path: Path, out: Path | None, chunk_size: int, run_batch: BatchRunner
) -> int:
    """The ``trio-gym run`` command: 0 on success, 1 with the attributed cause, 2 bad input."""
    try:
        examples = read_examples(examples_path)
    except ExamplesFileError as exc:
        print(f"trio-gym run: {exc}", file=sys.stderr)
        return 2
    sizes = [len(examples[i : i + chunk_size]) for i in range(0, len(examples), chunk_size)]
    progress = FileProgress(len(examples), sizes, sys.stderr)
    try:
        results = await run_batch(examples, progress)
    except RolloutError as exc:
        print(f"trio-gym run: failed ({exc.origin.value}): {exc.message}", file=sys.stderr)
        return 1
    except LaunchFailed as exc:
        print(f"trio-gym run: could not launch the hosts: {exc}", file=sys.stderr)
        return 1
    write_results(results, out)
    elapsed = trio.current_time() - progress.started
    print(f"trio-gym run: {len(results)} results in {elapsed:.1f} s", file=sys.stderr)
    return 0
