"""Whether a host took a chunk, as the pool acts on it, and a host that answers only the caller
that launched it. In-memory hosts and scripted gateways on virtual clocks; one test over real
processes (a second host takes over the first one's port)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import trio

from tests.canned import CannedHost, chunked_response, json_response, respond
from tests.fake_opensandbox import free_port
from tests.helpers import CountingRunner, in_memory, wire
from tests.processes import serve_process
from trio_gym.config import ServeConfig
from trio_gym.host import Host
from trio_gym.http import Endpoint, HttpLimits, exchange
from trio_gym.protocol.host_identity import HOST_IDENTITY_HEADER, identity_digest
from trio_gym.trainer import RolloutClient, RolloutError
from trio_gym.trainer.control import ControlError
from trio_gym.trainer.dispatch import RemoteHost
from trio_gym.trainer.errors import Origin, Reach
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.hosts import HealthStatus, HostHandle, probe
from trio_gym.trainer.pool import HostPool
from trio_gym.trainer.scheduler import SchedulerSettings

GATEWAY_GONE = json_response(
    502,
    b'{"code": "BACKEND_CONNECTION_FAILED", "message": "Could not connect to the backend '
    b'sandbox 127.0.0.1:18081: All connection attempts failed"}',
)
HEALTH_READY = json_response(200, b'{"status": "ready"}')
A, B = "http://10.0.0.1:8080", "http://10.0.0.2:8080"


def routed(openers: dict[str, Any]) -> Callable[[Endpoint], Any]:
    """One opener for a pool whose hosts are reached by different scripted openers."""

    async def open_stream(endpoint: Endpoint) -> trio.abc.Stream:
        stream: trio.abc.Stream = await openers[f"http://{endpoint.authority}"](endpoint)
        return stream

    return open_stream


def pool_over(handles: list[HostHandle], opener: Any, **settings: Any) -> HostPool:
    """A pool of chunks of one, probing every second, no backoff: the tests' clock is virtual.
    Scripted hosts keep no answers: nothing is reattached."""
    return HostPool(
        handles,
        SchedulerSettings(probe_interval_s=1, **settings),
        client_settings=ClientSettings(chunk_size=1, backoff_s=0, max_reattaches=0),
        opener=opener,
    )


def examples(count: int) -> list[dict[str, Any]]:
    return [{"seed": i, "meetings": 1, "think_s": 1, "_ng_task_index": i} for i in range(count)]


async def test_a_gateway_that_cannot_reach_a_host_costs_no_chunk_and_the_host_is_ejected(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    healthy = Host(ServeConfig(port=0), runner=runner)
    async with trio.open_nursery() as nursery:
        gone = CannedHost(nursery, [respond(GATEWAY_GONE)])
        opener = routed({A: gone.open, B: in_memory(nursery, healthy)})
        async with pool_over(
            [HostHandle("a", A), HostHandle("b", B)],
            opener,
            per_host_in_flight=2,
            max_host_failures=2,
        ) as pool:
            outcomes = await pool.outcomes(examples(6))
            assert [outcome["_ng_task_index"] for outcome in outcomes] == list(range(6))
            assert pool.ejected.keys() == {"a"}
    assert len(runner.started) == 6  # each ran once, on b
    assert len([body for body in gone.requests if body]) >= 1  # a was tried, and cost nothing


async def test_a_cut_answer_fails_its_chunk_once_and_its_host_is_probed_before_more_work(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        cut_then_ready = CannedHost(
            nursery,
            [
                respond(chunked_response(b" ")),
                respond(HEALTH_READY),
                respond(HEALTH_READY),
                respond(json_response(200, b'{"results": [{"ok": true}]}')),
            ],
        )
        async with pool_over(
            [HostHandle("a", A)], routed({A: cut_then_ready.open}), per_host_in_flight=1
        ) as pool:
            outcomes = await pool.outcomes([{"seed": 0}, {"seed": 1}])
    error = outcomes[0]
    assert isinstance(error, RolloutError)
    assert (error.origin, error.reach) == (Origin.PROXY, Reach.TAKEN)  # the host lives
    assert outcomes[1] == {"ok": True}
    # POST (cut), the client's GET /health naming the cut, the pool's probe, then the next POST.
    assert [bool(body) for body in cut_then_ready.requests] == [True, False, False, True]


async def test_a_stranger_at_a_hosts_address_is_refused_and_ejected_and_the_chunk_goes_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    stranger = Host(ServeConfig(port=0, host_identity="theirs"), runner=CountingRunner())
    ours = Host(ServeConfig(port=0, host_identity="ours-b"), runner=runner)
    async with trio.open_nursery() as nursery:
        opener = routed({A: in_memory(nursery, stranger), B: in_memory(nursery, ours)})
        async with pool_over(
            [HostHandle("a", A, identity="ours-a"), HostHandle("b", B, identity="ours-b")],
            opener,
            per_host_in_flight=1,
        ) as pool:
            outcomes = await pool.outcomes(examples(3))
            assert "its address now answers for another host" in pool.ejected["a"]
    assert [outcome["_ng_task_index"] for outcome in outcomes] == [0, 1, 2]
    assert len(runner.started) == 3  # each ran once, on b


async def test_a_host_with_an_identity_refuses_another_naming_neither_and_says_its_digest(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = Host(ServeConfig(port=0, host_identity="the-right-one"), runner=CountingRunner())
    async with trio.open_nursery() as nursery:
        opener = in_memory(nursery, host)

        async def ask(path: str, identity: str | None) -> tuple[int, dict[str, Any]]:
            headers = [] if identity is None else [(HOST_IDENTITY_HEADER, identity)]
            method, body = ("POST", json.dumps({"examples": examples(1)}).encode())
            if path == "/health":
                method, body = "GET", b""
            response = await exchange(
                Endpoint.parse(A),
                method,
                path,
                body,
                limits=HttpLimits(),
                max_response_bytes=1 << 20,
                idle_timeout_s=60,
                headers=[("content-type", "application/json"), *headers],
                opener=opener,
            )
            return response.status, json.loads(response.body)

        assert (await ask("/health", None))[1]["status"] == "ready"
        status, refusal = await ask("/rollouts/run", "a-stranger's")
        assert (status, refusal["error"]["code"]) == (421, "wrong_host")
        assert "the-right-one" not in json.dumps(refusal)
        assert "stranger" not in json.dumps(refusal)
        assert (await ask("/health", "a-stranger's"))[0] == 421
        status, answered = await ask("/rollouts/run", "the-right-one")
        assert status == 200 and len(answered["results"]) == 1
        status, refusal = await ask("/rollouts/run", None)  # a neighbour's curl: no identity
        assert (status, refusal["error"]["code"]) == (403, "identity_required")
        assert await ask("/health", None) == (200, {"status": "ready"})  # and nothing more
        status, health = await ask("/health", "the-right-one")
        assert health["identity"] == identity_digest("the-right-one") != "the-right-one"


@pytest.mark.parametrize("stranger_identity", ["theirs", None], ids=["with-one", "without"])
async def test_a_second_host_on_the_first_ones_port_refuses_the_first_ones_caller(
    stranger_identity: str | None,
) -> None:
    """A sandbox dies and another job's host gets its address: the first host's caller is
    refused by a stranger with an identity, and a probe finds out one without (README: such a
    stranger answers what reaches it before the probe)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = HostHandle("first", url, identity="ours")
    async with serve_process("--port", str(port), env={"NMP_HOST_IDENTITY": "ours"}):
        assert (await probe(first, timeout_s=10)).status is HealthStatus.READY
    stranger_env = {} if stranger_identity is None else {"NMP_HOST_IDENTITY": stranger_identity}
    async with serve_process("--port", str(port), env=stranger_env):
        health = await probe(first, timeout_s=10)
        assert health.status is HealthStatus.WRONG_HOST
        client = RolloutClient(url, ClientSettings(max_attempts=1), identity="ours")
        if stranger_identity is not None:
            with pytest.raises(RolloutError) as failure:
                await client.run(examples(1))
            assert failure.value.code == "wrong_host"
            assert failure.value.reach is Reach.UNREACHED


async def test_a_busy_host_is_probed_not_sent_the_same_chunk_again_and_not_ejected(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A host at its connection cap answers "not now" to the chunk and to its probe: the chunk
    goes to another host at once, the busy one gets nothing more while busy (a re-send loop
    would spend the chunk's sends in milliseconds) and is not ejected (busy is not failed)."""
    busy = json_response(503, b'{"error": {"code": "host_busy", "message": "at its maximum"}}')
    runner = CountingRunner()
    healthy = Host(ServeConfig(port=0), runner=runner)
    async with trio.open_nursery() as nursery:
        full = CannedHost(nursery, [respond(busy)])
        opener = routed({A: full.open, B: in_memory(nursery, healthy)})
        async with pool_over(
            [HostHandle("a", A), HostHandle("b", B)],
            opener,
            per_host_in_flight=1,
            max_host_failures=2,
        ) as pool:
            outcomes = await pool.outcomes(examples(4))
            assert [outcome["_ng_task_index"] for outcome in outcomes] == list(range(4))
            assert pool.ejected == {}
    assert len([body for body in full.requests if body]) == 1  # one chunk tried, then probes
    assert len(runner.started) == 4


async def test_a_dispatchers_host_carries_its_identity_on_rollouts_and_control_calls(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A checkpointing trainer's hosts, built from a provider's handles, reach only their own
    host: a stranger refuses both their batches and their control calls."""
    host = Host(
        ServeConfig(port=0, control_token="t0ken", host_identity="ours"), runner=CountingRunner()
    )
    async with trio.open_nursery() as nursery:
        opener = in_memory(nursery, host)
        ours = RemoteHost.launched(
            HostHandle("a", A, control_token="t0ken", identity="ours"), opener=opener
        )
        stranger = RemoteHost.launched(
            HostHandle("a", A, control_token="t0ken", identity="theirs"), opener=opener
        )
        assert (wire(await ours.control.status(timeout_s=5))) is not None
        assert len(await ours.client.post(examples(1))) == 1
        with pytest.raises(ControlError) as refused:
            await stranger.control.status(timeout_s=5)
        assert (refused.value.status, refused.value.code) == (421, "wrong_host")
        with pytest.raises(RolloutError) as failure:
            await stranger.client.post(examples(1))
        assert failure.value.code == "wrong_host"
