"""A user's own runner, loaded by import path in tests (``tests.user_runner:factory``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import trio

from trio_gym.runners import ExampleContext


class EchoRunner:
    """Two steps per example, each reported as a boundary; the result echoes the prompt."""

    def __init__(self) -> None:
        self.started = False

    async def start(self) -> None:
        self.started = True

    def check_example(self, example: Mapping[str, Any]) -> None:
        if not isinstance(example.get("prompt"), str):
            raise ValueError('needs a "prompt" string')  # noqa: TRY004 (the runner protocol's error)

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        assert self.started, "start() runs before any example"
        words: list[str] = []
        await context.boundary(0, {"words": words})
        for step, word in enumerate(example["prompt"].split()[:2], start=1):
            await trio.sleep(0.01)
            words.append(word.upper())
            await context.boundary(step, {"words": list(words)})
        return {"echo": " ".join(words), "reward": float(len(words))}


def factory() -> EchoRunner:
    return EchoRunner()


def not_a_runner() -> object:
    return object()


class RecordingRunner:
    """Writes a line to ``$TRIO_GYM_TEST_RECORD`` as each example starts (its ``id`` and this
    process's pid), then sleeps ``sleep_s``: tests count how often each example ran, and where.
    An example cancelled while it sleeps writes another line, marked ``cancelled``."""

    async def start(self) -> None:
        pass

    def check_example(self, example: Mapping[str, Any]) -> None:
        pass

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        _record(json.dumps({"id": example["id"], "pid": os.getpid()}))
        try:
            await trio.sleep(example.get("sleep_s", 0))
        except trio.Cancelled:
            _record(json.dumps({"id": example["id"], "pid": os.getpid(), "cancelled": True}))
            raise
        return {"id": example["id"], "pid": os.getpid(), "reward": 1.0}


def recording() -> RecordingRunner:
    return RecordingRunner()


class FailingStartRunner(RecordingRunner):
    async def start(self) -> None:
        raise RuntimeError("the model endpoint refused every connection")


def failing_start() -> FailingStartRunner:
    return FailingStartRunner()


def _record(line: str) -> None:
    with open(os.environ["TRIO_GYM_TEST_RECORD"], "a", encoding="utf-8") as record:
        record.write(line + "\n")  # one short appended write: lines of several hosts never mix


class FailingStartOnceMarkedRunner(RecordingRunner):
    """Fails its start once ``$TRIO_GYM_TEST_FAIL_START`` exists: hosts launched before the
    test creates that file start, their replacements do not."""

    async def start(self) -> None:
        if await trio.Path(os.environ["TRIO_GYM_TEST_FAIL_START"]).exists():
            raise RuntimeError("this image no longer starts")


def failing_start_once_marked() -> FailingStartOnceMarkedRunner:
    return FailingStartOnceMarkedRunner()
