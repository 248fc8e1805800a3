"""The `agents` runner through the real host, against Gym-compatible fake servers on loopback."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from tests.fake_gym import FakeAgentServer, FakeHeadServer, agent_instance, environment_instance
from tests.helpers import request_bytes, running_host, tcp_exchange
from trio_gym.config import ServeConfig
from trio_gym.host import Host
from trio_gym.runners import AgentError, AgentSettings, AgentsRunner, ExampleContext
from trio_gym.runners.agents import routes_of

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
            await host.settled.wait()
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
    assert host.stats.examples_cancelled == 2


async def test_an_agent_error_fails_its_example_with_the_status_and_an_excerpt() -> None:
    async with agents("flaky") as servers:
        urls = {"flaky": f"http://127.0.0.1:{servers['flaky'].port}"}
        async with agents_host(agents=urls) as (host, port):
            batch = {"examples": [example("flaky", status=500), example("flaky", delay_s=0.1)]}
            document = await tcp_exchange(port, request_bytes(batch))
            rows = await tcp_exchange(port, request_bytes(batch, headers=ROWS))
    message = document.json()["error"]["message"]
    assert message.startswith("example 0 failed: AgentError: agent 'flaky' at 127.0.0.1:")
    assert "answered HTTP 500: 'agent exploded: xxx" in message and "(2016 bytes)" in message
    lines = [json.loads(line) for line in rows.body.split(b"\n") if line.strip()]
    assert {line.get("index"): "error" in line for line in lines if "index" in line} == {
        0: True,
        1: False,
    }
    assert lines[-1] == {"done": True, "completed": 1, "failed": 1}


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
    config = {"agent_connect_attempts": 2, "agent_retry_backoff_s": 0.01}
    async with agents_host(head_server=f"http://127.0.0.1:{closed_port}", **config) as (
        host,
        port,
    ):
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
    assert health.status == 503 and health.json()["status"] == "failed"
    message = health.json()["error"]["message"]
    assert "cannot read the head server" in message and "(after 2 attempt(s))" in message


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


def test_an_agent_fronted_by_two_environment_servers_is_ambiguous_and_left_out() -> None:
    deployment = {
        "a": agent_instance(1),
        "b": agent_instance(2),
        "env_b1": environment_instance(3, agent="b"),
        "env_b2": environment_instance(4, agent="b"),
        "env_a": environment_instance(5, agent="a"),
    }
    routes = routes_of(deployment)
    assert set(routes) == {"a"} and routes["a"][0] == "env_a" and routes["a"][1].port == 5


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
