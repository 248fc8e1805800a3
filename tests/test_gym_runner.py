"""The optional gym runner: its asyncio isolation here; Gym itself only where it is installed."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import trio

from tests.helpers import request_bytes, running_host, tcp_exchange
from trio_gym.config import ServeConfig
from trio_gym.runners.gym import AsyncioThread, gym_available

HANG_GUARD_S = 30


async def test_asyncio_code_runs_on_its_own_thread_and_loop() -> None:
    bridge = AsyncioThread()
    try:

        async def where() -> tuple[int, bool]:
            await asyncio.sleep(0.01)
            return threading.get_ident(), asyncio.get_running_loop().is_running()

        ident, running = await bridge.call(where)
    finally:
        bridge.close()
    assert ident != threading.get_ident() and running
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()  # no asyncio loop leaked into the trio thread


async def test_cancelling_on_the_trio_side_cancels_the_asyncio_task() -> None:
    bridge = AsyncioThread()
    seen: list[str] = []

    async def long_gym_call() -> None:
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(0.05)  # cleanup that takes a moment, like closing a connection
            seen.append("cleaned up")
            raise

    try:
        with trio.move_on_after(0.1) as scope:
            await bridge.call(long_gym_call)
    finally:
        bridge.close()
    assert scope.cancelled_caught
    assert seen == ["cancelled", "cleaned up"]  # trio waited until asyncio had finished


async def test_an_asyncio_failure_propagates_as_itself() -> None:
    bridge = AsyncioThread()

    async def fails() -> None:
        raise KeyError("agent missing")

    try:
        with pytest.raises(KeyError, match="agent missing"):
            await bridge.call(fails)
    finally:
        bridge.close()


@pytest.mark.skipif(gym_available(), reason="nemo_gym is installed here")
async def test_without_nemo_gym_the_gym_runner_fails_its_start_naming_the_alternative() -> None:
    config = ServeConfig(port=0, runner="gym", head_server="http://127.0.0.1:9")
    async with running_host(config) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            await host.settled.wait()
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
    message = health.json()["error"]["message"]
    assert "needs the nemo_gym package" in message and "--runner agents" in message


@pytest.mark.skipif(not gym_available(), reason="nemo_gym needs Python >= 3.13.14")
async def test_the_gym_runner_runs_examples_through_gym_against_fake_servers() -> None:
    from tests.fake_gym import FakeAgentServer, FakeHeadServer, agent_instance

    agent = FakeAgentServer("math")
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.serve)
        head = FakeHeadServer({"math": agent_instance(agent.port)})
        head_port = await nursery.start(head.serve)
        config = ServeConfig(port=0, runner="gym", head_server=f"http://127.0.0.1:{head_port}")
        async with running_host(config) as (host, port):
            with trio.fail_after(HANG_GUARD_S):
                await host.settled.wait()
            batch = {"examples": [{"agent_ref": {"name": "math"}, "_ng_task_index": 0}]}
            reply = await tcp_exchange(port, request_bytes(batch))
        nursery.cancel_scope.cancel()
    assert reply.json()["results"][0]["agent"] == "math"


async def test_a_coroutine_factory_that_raises_is_reported_not_hung() -> None:
    bridge = AsyncioThread()

    def broken() -> Any:
        raise TypeError("not a coroutine factory after all")

    try:
        with trio.fail_after(HANG_GUARD_S), pytest.raises(TypeError, match="factory"):
            await bridge.call(broken)
    finally:
        bridge.close()
