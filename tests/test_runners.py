"""Runners by name and by import path, their start hook, and their step boundaries."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.helpers import ScriptedRunner, request_bytes, running_host, tcp_exchange
from trio_gym.config import ConfigError, ServeConfig, load_serve_config
from trio_gym.deadline import PausableDeadline
from trio_gym.host import Host
from trio_gym.protocol.identity import EpisodeId
from trio_gym.runners import ExampleContext, ExampleRunner, Runner

HANG_GUARD_S = 30


async def started_host_reply(runner: str, batch: dict[str, Any]) -> tuple[Any, Any, Any]:
    async with running_host(ServeConfig(port=0, runner=runner)) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            await host.lifecycle.settled.wait()
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
        reply = await tcp_exchange(port, request_bytes(batch)) if health.status == 200 else None
    return host, health, reply


async def test_a_user_runner_loaded_by_import_path_runs_end_to_end() -> None:
    batch = {"examples": [{"prompt": "hello big world", "_ng_task_index": 7}]}
    host, health, reply = await started_host_reply("tests.user_runner:factory", batch)
    assert health.json() == {"status": "ready"}
    (result,) = reply.json()["results"]
    assert result["echo"] == "HELLO BIG" and result["reward"] == 2.0
    assert result["_ng_task_index"] == 7 and "_ng_attempt_index" not in result
    assert host.services.episodes.boundaries == 3  # before the first step and after each of two


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


class RecordingHooks:
    def __init__(self) -> None:
        self.boundaries: list[tuple[int, str]] = []

    async def boundary(self, context: ExampleContext, step: int, state: Any) -> None:
        self.boundaries.append((step, json.dumps(state)))  # JSON-able, or this raises

    async def run_step(self, context: ExampleContext, step: Any, mode: str) -> Any:
        return await step()


@pytest.mark.parametrize("spec", ["tests.user_runner", "tests.user_runner:", "a b:c", ""])
def test_a_malformed_runner_spec_is_a_config_error_at_once(spec: str) -> None:
    with pytest.raises(ConfigError, match="expected 'example', 'agents', 'gym' or"):
        load_serve_config(environ={}, flags={"runner": spec})


async def test_the_example_runner_reports_every_step_boundary_as_json() -> None:
    hooks = RecordingHooks()
    runner = ExampleRunner()
    context = ExampleContext("b", 0, capture_key="r-1", hooks=hooks)
    result = await runner.run_example({"seed": 3, "meetings": 4}, context)
    assert [step for step, _ in hooks.boundaries] == [0, 1, 2, 3, 4]
    assert json.loads(hooks.boundaries[-1][1])["step"] == 4
    assert result["steps"] == 4 and len(runner.store) == 0


class Holding(ScriptedRunner):
    """A runner that holds something until the host has stopped serving (a ClosingRunner)."""

    def __init__(self) -> None:
        self.closed_with_connections_open: list[int] = []
        self.host: Host | None = None

    async def aclose(self) -> None:
        assert self.host is not None
        await trio.lowlevel.checkpoint()
        self.closed_with_connections_open.append(self.host.services.stats.connections_open)


async def test_a_runner_that_holds_something_is_closed_once_after_serving_ends() -> None:
    runner = Holding()
    async with running_host(runner=runner) as (host, port):
        runner.host = host
        reply = await tcp_exchange(port, request_bytes({"examples": [{"result": 1}]}))
        assert reply.json()["results"] == [1] and runner.closed_with_connections_open == []
    assert runner.closed_with_connections_open == [0]


class Reporting(ScriptedRunner):
    reports_boundaries = True


@pytest.mark.parametrize(("runner", "capturable"), [(ScriptedRunner(), False), (Reporting(), True)])
async def test_only_a_boundary_reporter_is_waited_for_before_its_first_boundary(
    runner: Runner, capturable: bool
) -> None:
    """An episode that has not reported a boundary yet is a blocker a checkpoint waits for when
    its runner promises boundaries, and a restart (never waited for) when it does not."""
    host = Host(ServeConfig(port=0, control_token="t"), runner=runner)
    live = host.services.episodes.admit(
        EpisodeId("r", 0), "b", 0, PausableDeadline(trio.CancelScope())
    )
    assert host.services.episodes.blockers() == ([live] if capturable else [])
    assert host.services.episodes.restarts() == ([] if capturable else [live])
