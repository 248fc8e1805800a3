"""``trio-gym run``: a JSON-lines file of examples in, a JSON-lines file of results out.

As NeMo Gym's collection writes its output: every result to ``--out`` in input order, and every
failure record — the host's for an example that failed (Gym's, when Gym ran it), or one made
here for each example of a chunk the host never answered (:data:`REQUEST_FAILED`, with the
chunk's error) — to ``<stem>_failures.jsonl`` beside it. One failure never costs another's
result: the hosts are asked for failure records in place (``failures="records"``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import trio

from trio_gym.files import write_whole
from trio_gym.protocol.rollouts import (
    FAILURE_CLASS_KEY,
    FAILURE_MESSAGE_KEY,
    FAILURE_STATUS_KEY,
    FAILURE_TYPE_KEY,
    REQUEST_FAILED,
    failure_identity,
    is_failure_record,
)
from trio_gym.trainer.errors import RolloutError
from trio_gym.trainer.hosts import LaunchFailed
from trio_gym.trainer.pool import Progress, batch_failure

# What a failure record made here says beside Gym's keys: where its chunk's failure came from.
FAILURE_ORIGIN_KEY = "_trio_gym_failure_origin"


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


def request_failure_record(
    example: Mapping[str, Any], position: int, error: RolloutError
) -> dict[str, Any]:
    """The failure record of an example whose chunk the host never answered: the chunk's error,
    and the example's row as a failure record names it."""
    return {
        FAILURE_CLASS_KEY: REQUEST_FAILED,
        FAILURE_TYPE_KEY: type(error).__name__,
        FAILURE_MESSAGE_KEY: error.message,
        FAILURE_STATUS_KEY: error.status,
        FAILURE_ORIGIN_KEY: error.origin.value,
        **failure_identity(example, position),
    }


def failures_path(out: Path | None, examples_path: Path) -> Path:
    """Where failure records go: ``<stem>_failures.jsonl`` beside ``--out`` (Gym's name for
    its sidecar), or named after the examples file in the working directory."""
    if out is None:
        return Path.cwd() / f"{examples_path.stem}_failures.jsonl"
    return out.with_name(f"{out.stem}_failures.jsonl")


def write_results(results: Sequence[Any], out: Path | None) -> None:
    """JSON lines, in input order; a file is written whole or not at all (temp + rename)."""
    lines = "".join(json.dumps(result) + "\n" for result in results)
    if out is None:
        sys.stdout.write(lines)
        sys.stdout.flush()
        return
    write_whole(out, lines.encode())


BatchRunner = Callable[[Sequence[Mapping[str, Any]], Progress], Awaitable[list[Any]]]
"""Runs one batch on the hosts the command was given, telling ``progress`` as it goes; for each
example, in input order, its result, its failure record, or its chunk's :class:`RolloutError`."""


async def run_file(
    examples_path: Path, out: Path | None, chunk_size: int, run_batch: BatchRunner
) -> int:
    """The ``trio-gym run`` command: 0 when every example has its result; 1 when any failed
    (the results written all the same, the failure records beside them, the cause said) or the
    hosts could not be launched; 2 for bad input."""
    try:
        examples = read_examples(examples_path)
    except ExamplesFileError as exc:
        print(f"trio-gym run: {exc}", file=sys.stderr)
        return 2
    sizes = [len(examples[i : i + chunk_size]) for i in range(0, len(examples), chunk_size)]
    progress = FileProgress(len(examples), sizes, sys.stderr)
    try:
        outcomes = await run_batch(examples, progress)
    except LaunchFailed as exc:
        print(f"trio-gym run: could not launch the hosts: {exc}", file=sys.stderr)
        return 1
    results: list[Any] = []
    failures: list[Any] = []
    chunk_errors: list[RolloutError] = []
    for position, (example, outcome) in enumerate(zip(examples, outcomes, strict=True)):
        if isinstance(outcome, RolloutError):
            failures.append(request_failure_record(example, position, outcome))
            if not any(outcome is seen for seen in chunk_errors):
                chunk_errors.append(outcome)
        elif is_failure_record(outcome):
            failures.append(outcome)
        else:
            results.append(outcome)
    write_results(results, out)
    sidecar = failures_path(out, examples_path)
    elapsed = trio.current_time() - progress.started
    where = f" in {out}" if out is not None else ""
    if not failures:
        sidecar.unlink(missing_ok=True)  # one of an earlier run would be read as this one's
        print(f"trio-gym run: {len(results)} results{where} in {elapsed:.1f} s", file=sys.stderr)
        return 0
    write_results(failures, sidecar)
    if chunk_errors:
        cause = batch_failure(chunk_errors, len(sizes))
        print(f"trio-gym run: failed ({cause.origin.value}): {cause.message}", file=sys.stderr)
    print(
        f"trio-gym run: {len(failures)} of {len(examples)} examples failed; their failure "
        f"records are in {sidecar}; {len(results)} results{where} in {elapsed:.1f} s",
        file=sys.stderr,
    )
    return 1
