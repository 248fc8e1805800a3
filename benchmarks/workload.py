"""The one example workload every server in the benchmark runs, for trio and for asyncio.

An example is ``{"n": <int>, "think_s": <seconds>, "blob_bytes": <optional int>, "tag": ...}``:
it sleeps its think time and returns ``{"reward": 1.0, "n": n}`` (plus ``blob_bytes`` of text
for the large-answer workload). When an example is cancelled, and ``BENCH_EVENTS`` names a file,
the example appends ``"<tag> <CLOCK_MONOTONIC seconds>"`` to it: the monotonic clock is shared by
every process on the machine, so the load generator can measure stop latency across processes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Mapping
from typing import Any

import trio

from trio_gym.runners import ExampleContext


def check(example: Mapping[str, Any]) -> None:
    think = example.get("think_s", 0)
    if not isinstance(think, (int, float)) or think < 0:
        raise ValueError("think_s must be a number of seconds, 0 or more")


def result(example: Mapping[str, Any]) -> dict[str, Any]:
    blob = example.get("blob_bytes", 0)
    return {"reward": 1.0, "n": example.get("n"), **({"blob": "x" * blob} if blob else {})}


def record_cancel(example: Mapping[str, Any]) -> None:
    events = os.environ.get("BENCH_EVENTS")
    tag = example.get("tag")
    if events and tag:
        with open(events, "a") as file:
            file.write(f"{tag} {time.monotonic()}\n")


class ThinkRunner:
    """The workload as a trio_gym runner (``NMP_RUNNER=benchmarks.workload:think_runner``)."""

    def check_example(self, example: Mapping[str, Any]) -> None:
        check(example)

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        try:
            await trio.sleep(example.get("think_s", 0))
        except trio.Cancelled:
            record_cancel(example)
            raise
        return result(example)


def think_runner() -> ThinkRunner:

    return ThinkRunner()


async def think_asyncio(example: Mapping[str, Any]) -> Any:
    """The workload for the asyncio peers."""
    try:
        await asyncio.sleep(example.get("think_s", 0))
    except asyncio.CancelledError:
        record_cancel(example)
        raise
    return result(example)


def peer_arguments(description: str | None) -> argparse.Namespace:
    """A peer's command line: ``PORT [--heartbeat-s SECONDS]``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("port", type=int)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    return parser.parse_args()
