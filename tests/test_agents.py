"""The `agents` runner through the real host, against Gym-compatible fake servers on loopback."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from tests.fake_gym import FakeAgentServer, FakeHeadServer, agent_instance, environment_instance
from tests.helpers import request_bytes, running_host, tcp_exchange
from trio_gym.config import ServeConfig
from trio_gym.host import Host
from trio_gym.runners import AgentError, AgentSettings, AgentsRunner, ExampleContext
from trio_gym.runners.base import start_reports_to
from trio_gym.runners.deployment import Deployment

HANG_GUARD_S = 30
ROWS = [("Accept", "application/x-ndjson")]


@asynccontextmanager
async def agents(*names: str) -> AsyncIterator[dict[str, FakeAgentServer]]:
    servers = {name: FakeAgentServer(name) for name in names}
    async with trio.open_nursery() as nursery:
        for server in servers.values():
            await nursery.start(server.serve)
        yield servers
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def agents_host(**config: Any) -> AsyncIterator[tuple[Host, int]]:
    async with running_host(ServeConfig(port=0, runner="agents", **config)) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            await host.lifecycle.settled.wait()
        yield host, port


def example(agent: str, **fake: Any) -> dict[str, Any]:
    return {"agent_ref": {"name": agent}, "responses_create_params": {"input": "hi"}, "_fake": fake}


async def test_results_and_identity_keys_come_back_untouched() -> None:
    async with agents("math", "code") as servers:
        urls = {name: f"http://127.0.0.1:{server.port}" for name, server in servers.items()}
        examples = [
            {**example("math", delay_s=0.2), "_ng_task_index": 0, "_ng_rollout_index": 1},
            {**example("code"), "_ng_task_index": 1, "_ng_rollout_index": 0, "_sg_example_id": "e"},
            {**example("math"), "_ng_task_index": 2, "_ng_rollout_index": 0},
        ]
        async with agents_host(agents=urls) as (host, port):
            reply = await tcp_exchange(port, request_bytes({"examples": examples}))
    results = reply.json()["results"]
    assert [r["agent"] for r in results] == ["math", "code", "math"]
    assert [r["_ng_task_index"] for r in results] == [0, 1, 2]  # restored: agents do not echo
    assert results[1]["_sg_example_id"] == "e" and results[0]["_ng_rollout_index"] == 1
    assert results[0]["reward"] == 0.5 and results[0]["response"] == {"output": []}
    received = sorted(servers["math"].requests, key=lambda e: e["_ng_task_index"])
    assert received == [examples[0], examples[2]]  # sent as given, once each
    assert servers["code"].requests == [examples[1]]


async def test_the_head_server_names_the_agents_and_environment_servers_front_them() -> None:
    async with agents("direct", "fronted", "front") as servers:
        deployment = {
            "direct": agent_instance(servers["direct"].port),
            "fronted": agent_instance(servers["fronted"].port),
            "fronted_env": environment_instance(servers["front"].port, agent="fronted"),
            "policy_model": {"responses_api_models": {"vllm_model": {"host": "x", "port": 1}}},
        }
        head = FakeHeadServer(deployment)
        async with trio.open_nursery() as nursery:
            head_port = await nursery.start(head.serve)
            async with agents_host(head_server=f"http://127.0.0.1:{head_port}") as (host, port):
                batch = {"examples": [example("direct"), example("fronted")]}
                reply = await tcp_exchange(port, request_bytes(batch))
            nursery.cancel_scope.cancel()
    assert [r["agent"] for r in reply.json()["results"]] == ["direct", "front"]
    assert servers["fronted"].requests == []  # reached through its environment server only
    assert head.reads == 1


async def test_an_unknown_agent_given_outright_is_refused_naming_the_known_ones() -> None:
    async with agents("math") as servers:
        urls = {"math": f"http://127.0.0.1:{servers['math'].port}"}
        async with agents_host(agents=urls) as (host, port):
            reply = await tcp_exchange(port, request_bytes({"examples": [example("poetry")]}))
            no_ref = await tcp_exchange(port, request_bytes({"examples": [{"seed": 1}]}))
    assert reply.status == 400
    message = reply.json()["error"]["message"]
    assert "unknown agent 'poetry'" in message and "'math'" in message
    assert no_ref.status == 400 and "agent_ref" in no_ref.json()["error"]["message"]
    assert servers["math"].requests == []


async def test_an_unknown_agent_makes_the_runner_ask_the_head_server_again() -> None:
    async with agents("math") as servers:
        head = FakeHeadServer({"math": agent_instance(servers["math"].port)})
        async with trio.open_nursery() as nursery:
            head_port = await nursery.start(head.serve)
            async with agents_host(head_server=f"http://127.0.0.1:{head_port}") as (host, port):
                batch = {"examples": [example("math"), example("poetry")]}
                reply = await tcp_exchange(port, request_bytes(batch, headers=ROWS))
            nursery.cancel_scope.cancel()
    lines = [json.loads(line) for line in reply.body.split(b"\n") if line.strip()]
    rows = {row["index"]: row for row in lines if "index" in row}
    assert rows[0]["result"]["agent"] == "math"
    assert "unknown agent 'poetry'; known agents: ['math']" in rows[1]["error"]["message"]
    assert head.reads == 2  # at start, and again for the name it did not know


async def test_refused_connections_are_retried_a_bounded_number_of_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trio_gym")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    config = {"agent_connect_attempts": 3, "agent_retry_backoff_s": 0.01}
    async with agents_host(agents={"gone": f"http://127.0.0.1:{closed_port}"}, **config) as (
        host,
        port,
    ):
        reply = await tcp_exchange(port, request_bytes({"examples": [example("gone")]}))
    error = reply.json()["error"]
    assert error["code"] == "internal"
    assert "agent 'gone': could not connect" in error["message"]
    assert "after 3 attempt(s)" in error["message"]
    assert caplog.text.count("agent_connect_retry") == 2


async def test_a_hung_agent_is_ended_by_the_deadline_and_sees_the_disconnect() -> None:
    async with agents("slow") as servers:
        urls = {"slow": f"http://127.0.0.1:{servers['slow'].port}"}
        async with agents_host(agents=urls) as (host, port):
            batch = {"examples": [example("slow", hang=True)], "deadline_s": 0.3}
            reply = await tcp_exchange(port, request_bytes(batch))
            with trio.fail_after(HANG_GUARD_S):
                await servers["slow"].wait_for(lambda s: s.disconnects == 1 and s.running == 0)
    assert reply.json()["error"]["code"] == "deadline_exceeded"
    assert len(servers["slow"].requests) == 1


async def test_a_caller_that_leaves_leaves_nothing_running_on_the_agent() -> None:
    async with agents("slow") as servers:
        urls = {"slow": f"http://127.0.0.1:{servers['slow'].port}"}
        async with agents_host(agents=urls) as (host, port):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            batch = {"examples": [example("slow", hang=True), example("slow", hang=True)]}
            await stream.send_all(request_bytes(batch))
            with trio.fail_after(HANG_GUARD_S):
                await servers["slow"].wait_for(lambda s: s.running == 2)
                await stream.aclose()
                await servers["slow"].wait_for(lambda s: s.running == 0)
    assert servers["slow"].disconnects == 2
    assert host.services.stats.examples_cancelled == 2


async def test_an_agent_error_fails_its_example_with_the_status_and_an_excerpt() -> None:
    async with agents("flaky") as servers:
        urls = {"flaky": f"http://127.0.0.1:{servers['flaky'].port}"}
        async with agents_host(agents=urls) as (host, port):
            batch = {"examples": [example("flaky", status=500), example("flaky", delay_s=0.1)]}
            document = await tcp_exchange(port, request_bytes(batch))
            rows = await tcp_exchange(port, request_bytes(batch, headers=ROWS))
    message = document.json()["error"]["message"]
    assert message.startswith("example 0 failed: RolloutFailed: agent 'flaky' at 127.0.0.1:")
    assert "answered HTTP 500: agent exploded: xxx" in message and "(2016 bytes)" in message
    lines = [json.loads(line) for line in rows.body.split(b"\n") if line.strip()]
    assert {line.get("index"): "error" in line for line in lines if "index" in line} == {
        0: True,
        1: False,
    }
    assert lines[-1] == {"done": True, "completed": 1, "failed": 1}
    # The sidecar row carries the failure record Gym's collection writes for a failed /run.
    record = next(line for line in lines if line.get("index") == 0)["record"]
    assert record["_ng_failure_class"] == "agent_run_error"  # a server answered: it ran, broke
    assert record["_ng_failure_type"] == "HTTPStatusError"
    assert record["_ng_failure_http_status"] == 500
    body = record["_ng_failure_response_body"]
    assert body.startswith("agent exploded: xxx") and body.endswith("…") and len(body) == 2001
    assert "answered HTTP 500" in record["_ng_failure_message"]
    assert (record["_ng_task_index"], record["_ng_rollout_index"]) == (0, 0)  # numbered
    assert record["agent_ref"] == {"name": "flaky"}


async def test_a_dropped_connection_is_not_resent_and_requests_match_sends() -> None:
    async with agents("dropper") as servers:
        urls = {"dropper": f"http://127.0.0.1:{servers['dropper'].port}"}
        async with agents_host(agents=urls) as (host, port):
            batch = {"examples": [example("dropper", drop=True)] + [example("dropper")] * 4}
            reply = await tcp_exchange(port, request_bytes(batch, headers=ROWS))
    lines = [json.loads(line) for line in reply.body.split(b"\n") if line.strip()]
    assert lines[-1] == {"done": True, "completed": 4, "failed": 1}
    assert (
        "without answering"
        in next(line for line in lines if line.get("index") == 0)["error"]["message"]
    )
    assert len(servers["dropper"].requests) == 5  # five sent, five received: nothing re-sent


async def test_concurrency_toward_one_agent_server_is_bounded() -> None:
    async with agents("busy") as servers:
        urls = {"busy": f"http://127.0.0.1:{servers['busy'].port}"}
        async with agents_host(agents=urls, agent_max_connections=2) as (host, port):
            batch = {"examples": [example("busy", delay_s=0.1) for _ in range(6)]}
            reply = await tcp_exchange(port, request_bytes(batch))
    assert len(reply.json()["results"]) == 6
    assert servers["busy"].peak == 2


async def test_an_unreachable_head_server_fails_the_start_with_the_reason() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    config = {"gym_start_timeout_s": 0.3, "agent_retry_backoff_s": 0.01}
    async with agents_host(head_server=f"http://127.0.0.1:{closed_port}", **config) as (
        host,
        port,
    ):
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
    assert health.status == 503 and health.json()["status"] == "failed"
    message = health.json()["error"]["message"]
    assert "was not up within 0.3 s (gym_start_timeout_s)" in message
    assert "does not answer yet: could not connect" in message


@pytest.mark.parametrize(
    ("fake", "fragment"),
    [({"cut": True}, "peer closed connection"), ({"status": 404}, "answered HTTP 404")],
    ids=["body-cut-after-headers", "client-error-status"],
)
async def test_an_agent_that_answers_badly_fails_its_example_and_gets_it_once(
    fake: dict[str, Any], fragment: str
) -> None:
    async with agents("odd") as servers:
        urls = {"odd": f"http://127.0.0.1:{servers['odd'].port}"}
        async with agents_host(agents=urls) as (host, port):
            reply = await tcp_exchange(port, request_bytes({"examples": [example("odd", **fake)]}))
    assert reply.json()["error"]["code"] == "internal"
    assert fragment in reply.json()["error"]["message"]
    assert len(servers["odd"].requests) == 1


async def test_unknown_names_arriving_together_share_one_head_server_read() -> None:
    async with agents("math") as servers:
        head = FakeHeadServer({"math": agent_instance(servers["math"].port)})
        async with trio.open_nursery() as nursery:
            head_port = await nursery.start(head.serve)
            async with agents_host(head_server=f"http://127.0.0.1:{head_port}") as (host, port):
                batch = {"examples": [example(f"poetry{i}") for i in range(6)]}
                await tcp_exchange(port, request_bytes(batch, headers=ROWS))
            nursery.cancel_scope.cancel()
    assert head.reads == 2  # once at start, once shared by all six unknown names


def test_an_agent_fronted_by_two_environment_servers_is_ambiguous() -> None:
    deployment = Deployment.parse(
        {
            "a": agent_instance(1),
            "b": agent_instance(2),
            "env_b1": environment_instance(3, agent="b"),
            "env_b2": environment_instance(4, agent="b"),
            "env_a": environment_instance(5, agent="a"),
        }
    )
    front = deployment.server_for_agent("a")
    assert front is not None and (front.name, front.endpoint.port) == ("env_a", 5)
    with pytest.raises(AgentError, match=r"agent 'b' is fronted by several .*'env_b1', 'env_b2'"):
        deployment.server_for_agent("b")


async def test_connection_retries_back_off_outside_the_servers_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    tried: list[float] = []

    async def refuse(endpoint: Any) -> trio.abc.Stream:
        tried.append(trio.current_time())
        raise ConnectionRefusedError(111, "Connection refused")

    settings = AgentSettings(
        agents={"a": "http://agent.invalid:1"},
        connect_attempts=4,
        retry_backoff_s=2,
        max_connections=1,
    )
    runner = AgentsRunner(settings, opener=refuse)
    with pytest.raises(AgentError, match="after 4 attempt"):
        await runner.run_example({"agent_ref": {"name": "a"}}, ExampleContext("b", 0))
    assert [round(t - tried[0], 6) for t in tried] == [0, 2, 6, 12]  # waits of 1x, 2x, 3x backoff


async def test_in_a_row_stream_an_example_naming_an_unknown_agent_is_a_sidecar_row() -> None:
    async with agents("math") as servers:
        urls = {"math": f"http://127.0.0.1:{servers['math'].port}"}
        async with agents_host(agents=urls) as (host, port):
            batch = {"examples": [example("poetry"), example("math")]}
            reply = await tcp_exchange(port, request_bytes(batch, headers=ROWS))
    lines = [json.loads(line) for line in reply.body.split(b"\n") if line.strip()]
    refused = next(line for line in lines if line.get("index") == 0)
    assert refused["error"]["code"] == "invalid_request" and "poetry" in refused["error"]["message"]
    assert next(line for line in lines if line.get("index") == 1)["result"]["agent"] == "math"


# --- Gym's record protocol --------------------------------------------------------------------


@asynccontextmanager
async def deployment_host(
    deployment: dict[str, Any], **config: Any
) -> AsyncIterator[tuple[Host, int, FakeHeadServer]]:
    head = FakeHeadServer(deployment)
    async with trio.open_nursery() as nursery:
        head_port = await nursery.start(head.serve)
        async with agents_host(head_server=f"http://127.0.0.1:{head_port}", **config) as (
            host,
            port,
        ):
            yield host, port, head
        nursery.cancel_scope.cancel()


async def test_records_carry_what_gyms_collection_stamps_and_nothing_invented() -> None:
    async with agents("agent", "env") as servers:
        deployment = {
            "weather_agent": agent_instance(servers["agent"].port),
            "weather_env": environment_instance(
                servers["env"].port, "weather_agent", implementation="single_agent_turn_legacy"
            ),
        }
        plain = {**example("weather_agent"), "_ng_task_index": 3, "_ng_rollout_index": 0}
        named = {**example("weather_agent"), "_ng_rollout_id": "r-9", "_ng_attempt_index": 2}
        sourced = {**example("weather_agent"), "task_source": "weather", "skills_ref": "s"}
        async with deployment_host(deployment) as (host, port, head):
            batch = {"examples": [plain, named, sourced]}
            reply = await tcp_exchange(port, request_bytes(batch))
    first, second, third = reply.json()["results"]
    for result in (first, second, third):
        assert result["agent_ref"] == {"name": "weather_agent"}
        assert result["_ng_environment_server"] == "weather_env"
        assert result["_ng_result_type"] == "single_agent_turn_legacy"
    assert "_ng_rollout_id" not in first and "_ng_attempt_index" not in first  # none in the row
    assert (first["_ng_task_index"], first["_ng_rollout_index"]) == (3, 0)
    assert (second["_ng_rollout_id"], second["_ng_attempt_index"]) == ("r-9", 2)
    assert (third["task_source"], third["skills_ref"]) == ("weather", "s")
    assert servers["agent"].requests == []  # every row went through the environment server
    # Numbered as Gym's collection numbers them: a task index from the row's position.
    numbered = [plain, {**named, "_ng_task_index": 1}, {**sourced, "_ng_task_index": 2}]
    numbered = [{"_ng_rollout_index": 0, **row} for row in numbered]
    assert sorted(servers["env"].requests, key=str) == sorted(numbered, key=str)
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in (second, third)] == [
        (1, 0),
        (2, 0),
    ]


async def test_an_agent_named_outright_stamps_its_ref_and_no_environment_server() -> None:
    async with agents("math") as servers:
        urls = {"math": f"http://127.0.0.1:{servers['math'].port}"}
        async with agents_host(agents=urls) as (host, port):
            reply = await tcp_exchange(port, request_bytes({"examples": [example("math")]}))
    (result,) = reply.json()["results"]
    assert result["agent_ref"] == {"name": "math"}
    assert "_ng_environment_server" not in result and "_ng_result_type" not in result


async def test_every_field_typed_as_an_agent_puts_its_environment_server_in_front() -> None:
    async with agents("user", "assistant", "sim") as servers:
        deployment = {
            "sim_user": agent_instance(servers["user"].port),
            "helper": agent_instance(servers["assistant"].port),
            "conversation": environment_instance(
                servers["sim"].port,
                implementation="nemo_user_sim",
                user_agent={"type": "responses_api_agents", "name": "sim_user"},
                assistant_agent={"type": "responses_api_agents", "name": "helper"},
                resources_server={"type": "resources_servers", "name": "tools"},
            ),
        }
        async with deployment_host(deployment) as (host, port, head):
            batch = {"examples": [example("sim_user"), example("helper")]}
            reply = await tcp_exchange(port, request_bytes(batch))
    assert [r["agent"] for r in reply.json()["results"]] == ["sim", "sim"]
    assert servers["user"].requests == servers["assistant"].requests == []


async def test_a_row_naming_its_environment_server_goes_there() -> None:
    async with agents("a", "env1", "env2") as servers:
        deployment = {
            "a": agent_instance(servers["a"].port),
            "env1": environment_instance(servers["env1"].port, "a"),
            "env2": environment_instance(servers["env2"].port, "a"),
        }
        row = {**example("a"), "_ng_environment_server": "env2"}
        async with deployment_host(deployment) as (host, port, head):
            reply = await tcp_exchange(port, request_bytes({"examples": [row]}))
            ambiguous = await tcp_exchange(port, request_bytes({"examples": [example("a")]}))
    assert reply.json()["results"][0]["_ng_environment_server"] == "env2"
    assert len(servers["env2"].requests) == 1 and servers["env1"].requests == []
    assert "fronted by several environment servers" in ambiguous.json()["error"]["message"]


async def test_a_taskset_row_is_an_episode_request_to_its_routed_environment_server() -> None:
    async with agents("env") as servers:
        deployment = {
            "weather_env": environment_instance(servers["env"].port),
            "environment_server_routes": {"weather": "weather_env"},
        }
        row = {
            "task_id": {"taskset": "weather", "task_id": "7"},
            "task_input": {"city": "sf"},
            "_ng_task_index": 7,
            "_ng_rollout_index": 1,
        }
        unrouted = {**row, "task_id": {"taskset": "chess", "task_id": "1"}}
        anonymous = {"task_id": {"taskset": "weather"}, "task_input": {}}
        async with deployment_host(deployment) as (host, port, head):
            reply = await tcp_exchange(
                port, request_bytes({"examples": [row, unrouted]}, headers=ROWS)
            )
            refused = await tcp_exchange(port, request_bytes({"examples": [anonymous]}))
    lines = {
        line["index"]: line
        for line in map(json.loads, reply.body.split(b"\n")[:-1])
        if "index" in line
    }
    assert servers["env"].requests[0] == {
        "episode_id": {"rollout_id": "7-1", "attempt": 0},
        "task": {"task_id": {"taskset": "weather", "task_id": "7"}, "task_input": {"city": "sf"}},
    }
    result = lines[0]["result"]
    assert result["reward"] == 0.5 and result["_ng_task_id"] == "t"
    assert result["_ng_environment_server"] == "weather_env" and "agent_ref" not in result
    assert "routes no taskset 'chess'" in lines[1]["error"]["message"]
    assert refused.status == 400 and "to name its episode" in refused.json()["error"]["message"]


async def test_an_agents_error_body_is_quoted_once_and_readable() -> None:
    async with agents("flaky") as servers:
        urls = {"flaky": f"http://127.0.0.1:{servers['flaky'].port}"}
        async with agents_host(agents=urls) as (host, port):
            batch = {"examples": [example("flaky", status=500, json_error=True)]}
            reply = await tcp_exchange(port, request_bytes(batch))
    message = reply.json()["error"]["message"]
    assert 'answered HTTP 500: Hit an exception in SimpleAgent: it "broke"\n' in message


@asynccontextmanager
async def in_memory_agents(*names: str) -> AsyncIterator[tuple[dict[str, FakeAgentServer], Any]]:
    """Fake agents reached over memory streams (virtual time): agent i listens on port i + 1."""
    servers = {name: FakeAgentServer(name) for name in names}
    by_port = {index + 1: server for index, server in enumerate(servers.values())}
    async with trio.open_nursery() as nursery:

        async def open_stream(endpoint: Any) -> trio.abc.Stream:
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(by_port[endpoint.port].handle, server)
            return client

        yield servers, open_stream
        nursery.cancel_scope.cancel()


async def test_a_failed_rollout_is_tried_again_counting_attempts_then_succeeds(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with in_memory_agents("a") as (servers, opener):
        settings = AgentSettings(agents={"a": "http://a:1"}, retry_backoff_s=2, rollout_attempts=3)
        runner = AgentsRunner(settings, opener=opener)
        row = example("a", failure_class="environment_server_failed", fail_times=2)
        started = trio.current_time()
        result = await runner.run_example(row, ExampleContext("b", 0))
        took = trio.current_time() - started
    assert "_ng_failure_class" not in result and result["reward"] == 0.5
    assert [r.get("_ng_attempt_index") for r in servers["a"].requests] == [None, 1, 2]
    assert result["_ng_attempt_index"] == 2  # the try that produced it, as Gym stamps it
    assert took == 2 + 4  # backoff 1x, 2x between the tries


@pytest.mark.parametrize(
    ("terminal", "tries"), [(False, 3), (True, 1)], ids=["retried", "terminal"]
)
async def test_a_rollout_gym_keeps_failing_fails_its_example_naming_the_class(
    autojump_clock: trio.abc.Clock, terminal: bool, tries: int
) -> None:
    async with in_memory_agents("a") as (servers, opener):
        settings = AgentSettings(agents={"a": "http://a:1"}, retry_backoff_s=1, rollout_attempts=3)
        runner = AgentsRunner(settings, opener=opener)
        row = {
            **example("a", failure_class="agent_run_error", fail_times=9, terminal=terminal),
            "_ng_attempt_index": 4,
        }
        with pytest.raises(AgentError, match="_ng_failure_class=agent_run_error") as caught:
            await runner.run_example(row, ExampleContext("b", 0))
    assert len(servers["a"].requests) == tries
    assert [r["_ng_attempt_index"] for r in servers["a"].requests] == [4, 5, 6][:tries]
    assert ("terminal" if terminal else "after 3 attempt(s)") in str(caught.value)


async def test_with_the_control_plane_on_the_runner_makes_no_attempts_of_its_own() -> None:
    async with agents("a") as servers:
        urls = {"a": f"http://127.0.0.1:{servers['a'].port}"}
        async with agents_host(agents=urls, control_token="t") as (host, port):
            failing = example("a", failure_class="environment_server_failed", fail_times=9)
            reply = await tcp_exchange(port, request_bytes({"examples": [failing]}, headers=ROWS))
    (failed,) = [json.loads(line) for line in reply.body.split(b"\n") if b'"index"' in line]
    assert "(after 1 attempt(s))" in failed["error"]["message"]
    assert len(servers["a"].requests) == 1  # the trainer's ledger numbers the attempts


async def test_a_gym_failure_record_is_a_failed_row_not_a_result() -> None:
    async with agents("a") as servers:
        urls = {"a": f"http://127.0.0.1:{servers['a'].port}"}
        async with agents_host(agents=urls, agent_retry_backoff_s=0.01) as (host, port):
            failing = example("a", failure_class="environment_server_failed", fail_times=9)
            batch = {"examples": [failing, example("a")]}
            reply = await tcp_exchange(port, request_bytes(batch, headers=ROWS))
    lines = [json.loads(line) for line in reply.body.split(b"\n") if line.strip()]
    assert lines[-1] == {"done": True, "completed": 1, "failed": 1}
    failed = next(line for line in lines if line.get("index") == 0)
    assert "_ng_failure_class=environment_server_failed" in failed["error"]["message"]
    assert len(servers["a"].requests) == 3 + 1  # three tries of the failing row, one of the other


@pytest.mark.parametrize(
    ("fake", "failure_class", "status"),
    [
        ({"status": 500}, "agent_run_error", 500),  # a Gym server answered: it ran, and broke
        ({"status": 503}, "agent_request_failed", 503),  # a gateway's: nothing known of it
        ({"status": 429}, "agent_request_failed", 429),
        ({"drop": True}, "agent_request_failed", None),  # no answer at all
        ({"cut": True}, "agent_run_error", 200),  # the body died after its head
    ],
)
async def test_a_failed_run_is_the_failure_record_gyms_collection_writes_for_it(
    fake: dict[str, Any], failure_class: str, status: int | None
) -> None:
    async with agents("a") as servers:
        urls = {"a": f"http://127.0.0.1:{servers['a'].port}"}
        async with agents_host(agents=urls) as (host, port):
            batch = {"examples": [example("a", **fake)], "failures": "records"}
            reply = await tcp_exchange(port, request_bytes(batch))
    (record,) = reply.json()["results"]
    assert record["_ng_failure_class"] == failure_class
    assert record["_ng_failure_http_status"] == status
    assert record["agent_ref"] == {"name": "a"} and record["_ng_task_index"] == 0
    assert len(servers["a"].requests) == 1  # it reached the server: never sent twice


# --- a deployment that is not up yet -----------------------------------------------------------


async def test_the_start_waits_for_a_head_server_that_comes_up_later(
    autojump_clock: trio.abc.Clock,
) -> None:
    head = FakeHeadServer({"math": agent_instance(1)}, ready=False)
    progress: list[tuple[float, str]] = []
    async with trio.open_nursery() as nursery:

        async def open_stream(endpoint: Any) -> trio.abc.Stream:
            if trio.current_time() < 30:
                raise ConnectionRefusedError(111, "Connection refused")
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(head.handle, server)
            return client

        settings = AgentSettings(agents={}, head_server="http://head:2", start_timeout_s=600)
        runner = AgentsRunner(settings, opener=open_stream)

        async def ready_at_60() -> None:
            await trio.sleep(60)
            head.ready = True

        nursery.start_soon(ready_at_60)

        class Reports:
            def progress(self, detail: str) -> None:
                progress.append((trio.current_time(), detail))

            def note(self, text: str) -> None:
                raise AssertionError(f"nothing to note, but {text!r}")

        with start_reports_to(Reports()):
            await runner.start()
        up = trio.current_time()
    assert 60 <= up <= 65  # looked at again within the largest backoff
    assert runner.directory.known() == ["math"]
    assert "does not answer yet" in progress[0][1]
    assert any("not ready (HTTP 503)" in detail for at, detail in progress if at >= 30)


async def test_a_head_server_never_up_fails_the_start_at_the_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def refuse(endpoint: Any) -> trio.abc.Stream:
        raise ConnectionRefusedError(111, "Connection refused")

    settings = AgentSettings(agents={}, head_server="http://head:2", start_timeout_s=100)
    runner = AgentsRunner(settings, opener=refuse)
    with pytest.raises(AgentError, match=r"not up within 100 s \(gym_start_timeout_s\)"):
        await runner.start()
    assert trio.current_time() == pytest.approx(100)


async def test_a_host_started_before_its_deployment_is_starting_then_ready() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        head_port = probe.getsockname()[1]
    async with agents("math") as servers:
        head = FakeHeadServer({"math": agent_instance(servers["math"].port)})
        config = ServeConfig(
            port=0,
            runner="agents",
            head_server=f"http://127.0.0.1:{head_port}",
            agent_retry_backoff_s=0.05,
        )
        async with running_host(config) as (host, port), trio.open_nursery() as nursery:
            with trio.fail_after(HANG_GUARD_S):
                await host.lifecycle.wait_for_phase(
                    lambda phase: "does not answer yet" in getattr(phase, "detail", "")
                )
            starting = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
            await nursery.start(partial(head.serve, port=head_port))
            with trio.fail_after(HANG_GUARD_S):
                await host.lifecycle.settled.wait()
            reply = await tcp_exchange(port, request_bytes({"examples": [example("math")]}))
            nursery.cancel_scope.cancel()
    assert starting.status == 503 and starting.json()["stage"] == "starting_runner"
    assert "the head server at 127.0.0.1" in starting.json()["detail"]
    assert reply.json()["results"][0]["agent"] == "math"
