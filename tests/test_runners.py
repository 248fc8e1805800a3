"""Runners by name and by import path, their start hook, and their step boundaries."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.helpers import request_bytes, running_host, tcp_exchange
from trio_gym.config import ServeConfig
from trio_gym.runners import ExampleContext, ExampleRunner

HANG_GUARD_S = 30


async def started_host_reply(runner: str, batch: dict[str, Any]) -> tuple[Any, Any, Any]:
    async with running_host(ServeConfig(port=0, runner=runner)) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            await host.settled.wait()
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
        reply = await tcp_exchange(port, request_bytes(batch)) if health.status == 200 else None
    return host, health, reply


async def test_a_user_runner_loaded_by_import_path_runs_end_to_end() -> None:
    batch = {"examples": [{"prompt": "hello big world", "_ng_task_index": 7}]}
    host, health, reply = await started_host_reply("tests.user_runner:factory", batch)
    assert health.json() == {"status": "ready"}
    assert reply.json()["results"] == [{"echo": "HELLO BIG", "reward": 2.0, "_ng_task_index": 7}]
    assert host.stats.step_boundaries == 3  # before the first step and after each of two


async def test_a_user_runners_check_refuses_a_bad_example_with_400() -> None:
    host, health, reply = await started_host_reply(
        "tests.user_runner:factory", {"examples": [{"prompt": 3}]}
    )
    assert (
        reply.status == 400 and 'examples[0]: needs a "prompt"' in reply.json()["error"]["message"]
    )


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("tests.user_runner", "expected 'example', 'agents', 'gym' or 'package.module:factory'"),
        ("tests.no_such_module:factory", "cannot import 'tests.no_such_module'"),
        ("tests.user_runner:missing", "has no attribute 'missing'"),
        ("tests.user_runner:not_a_runner", "returned object, which lacks check_example"),
    ],
)
async def test_a_runner_that_cannot_be_loaded_is_reported_on_health(
    spec: str, fragment: str
) -> None:
    host, health, reply = await started_host_reply(spec, {"examples": []})
    assert health.status == 503 and health.json()["stage"] == "starting_runner"
    assert fragment in health.json()["error"]["message"]


async def test_the_example_runner_reports_every_step_boundary_as_json() -> None:
    boundaries: list[tuple[int, str]] = []

    async def record(context: ExampleContext, step: int, state: Any) -> None:
        boundaries.append((step, json.dumps(state)))  # JSON-able, or this raises

    runner = ExampleRunner()
    context = ExampleContext("b", 0, on_boundary=record)
    result = await runner.run_example({"seed": 3, "meetings": 4}, context)
    assert [step for step, _ in boundaries] == [0, 1, 2, 3, 4]
    last = json.loads(boundaries[-1][1])
    assert last["state"]["step"] == 4
    assert len(last["events"]) == len(result["booked"])  # the side effects travel with the state
