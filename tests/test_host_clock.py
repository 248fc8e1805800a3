"""Timing rules on a virtual clock over in-memory streams: heartbeats, deadlines, departures.

``autojump_clock`` jumps whenever every task waits, so a 30-minute batch runs in milliseconds
and every time below is exact.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from tests.helpers import CountingRunner, exchange, read_reply, request_bytes
from trio_gym.config import ServeConfig
from trio_gym.host import Host, handle_connection


def make_host(runner: CountingRunner, **overrides: Any) -> Host:
    return Host(ServeConfig(port=0, **overrides), runner=runner)


def open_connection(nursery: trio.Nursery, host: Host) -> trio.StapledStream[Any, Any]:
    client, server = trio.testing.memory_stream_pair()
    nursery.start_soon(handle_connection, host, server)
    return client


def episodes(count: int, *, meetings: int, think_s: float) -> dict[str, Any]:
    return {
        "examples": [{"seed": i, "meetings": meetings, "think_s": think_s} for i in range(count)]
    }


async def test_heartbeat_cadence_over_a_30_minute_batch(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    host = make_host(runner, heartbeat_interval_s=15, rollout_deadline_s=3600)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        # 6 steps x 300 s of thinking: the batch takes exactly 1800 s.
        reply = await exchange(client, request_bytes(episodes(2, meetings=6, think_s=300)))

    assert reply.status == 200
    assert reply.headers["transfer-encoding"] == "chunked"
    assert reply.headers["connection"] == "close"
    assert reply.head_at - start == 0  # the status line left before any work was done
    assert reply.ended_at - start == 1800
    beats = [at - start for at in reply.heartbeat_times]
    # A heartbeat and the batch's end may tie at 1800 s; the count there is not asserted.
    assert beats[:119] == [15.0 * k for k in range(1, 120)]
    assert len(beats) in (119, 120)
    document = json.loads(reply.body)  # heartbeats plus the document: one JSON value
    assert [result["seed"] for result in document["results"]] == [0, 1]
    assert len(runner.completed) == 2 and not runner.cancelled


async def test_deadline_cancels_every_running_example(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    host = make_host(runner, heartbeat_interval_s=15, rollout_deadline_s=3600)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        request = {**episodes(5, meetings=3, think_s=100), "deadline_s": 60}
        reply = await exchange(client, request_bytes(request))

    assert reply.status == 200 and reply.complete
    assert reply.json()["error"]["code"] == "deadline_exceeded"
    assert reply.ended_at - start == 60
    assert len(runner.started) == 5
    assert sorted(index for index, _ in runner.cancelled) == [0, 1, 2, 3, 4]
    assert all(at - start == 60 for _, at in runner.cancelled)
    assert not runner.completed
    assert host.stats.examples_cancelled == 5 and host.stats.examples_running == 0


async def test_host_deadline_caps_the_request_deadline(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    host = make_host(runner, rollout_deadline_s=30)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        request = {**episodes(1, meetings=3, think_s=100), "deadline_s": 5000}
        reply = await exchange(client, request_bytes(request))
    assert reply.json()["error"]["code"] == "deadline_exceeded"
    assert reply.ended_at - start == 30


async def test_disconnect_mid_batch_cancels_every_example_within_one_interval(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = make_host(runner, heartbeat_interval_s=15)
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        await client.send_all(request_bytes(episodes(4, meetings=6, think_s=300)))
        await runner.wait_for(lambda r: len(r.started) == 4)
        await trio.sleep(100)
        left_at = trio.current_time()
        await client.aclose()
        await runner.wait_for(lambda r: len(r.cancelled) == 4)

    assert sorted(index for index, _ in runner.cancelled) == [0, 1, 2, 3]
    assert max(at for _, at in runner.cancelled) - left_at <= 15
    assert not runner.completed
    assert host.stats.examples_running == 0 and host.stats.batches_running == 0


async def test_half_closed_caller_still_gets_its_answer(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    host = make_host(runner, heartbeat_interval_s=15)
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        reply = await exchange(
            client, request_bytes(episodes(3, meetings=3, think_s=40)), half_close=True
        )
    assert reply.status == 200 and reply.complete
    assert len(reply.json()["results"]) == 3
    assert len(runner.completed) == 3 and not runner.cancelled


async def test_shutdown_answers_in_flight_batches_with_shutting_down(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = make_host(runner, heartbeat_interval_s=15)
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        await client.send_all(request_bytes(episodes(3, meetings=3, think_s=100)))
        await runner.wait_for(lambda r: len(r.started) == 3)
        await trio.sleep(50)
        host.request_shutdown()
        reply = await read_reply(client)
    assert reply.status == 200 and reply.complete
    assert reply.json()["error"]["code"] == "shutting_down"
    assert len(runner.cancelled) == 3


async def test_silent_caller_gets_408_after_the_read_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = make_host(CountingRunner(), read_timeout_s=30)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        await client.send_all(b"POST /rollouts/run HTTP/1.1\r\nHost: x\r\n")  # never finished
        reply = await read_reply(client)
    assert reply.status == 408
    assert reply.json()["error"]["code"] == "request_timeout"
    assert reply.head_at - start == 30


async def test_a_stalled_body_gets_408_after_the_read_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = make_host(CountingRunner(), read_timeout_s=30)
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        await client.send_all(request_bytes(b'{"examples": []}')[:-4])
        reply = await read_reply(client)
    assert reply.status == 408
    assert "12 bytes received" in reply.json()["error"]["message"]


async def test_caller_that_stops_reading_is_given_up_and_its_examples_cancelled(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = make_host(runner, heartbeat_interval_s=15, send_timeout_s=60)
    client, server = trio.testing.lockstep_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(handle_connection, host, server)
        await client.send_all(request_bytes(episodes(2, meetings=6, think_s=300)))
        head = b""
        while not head.endswith(b"\r\n\r\n"):  # read the head, then nothing more
            head += await client.receive_some(1)
        assert head.startswith(b"HTTP/1.1 200")
        await runner.wait_for(lambda r: len(r.cancelled) == 2)
        given_up_at = trio.current_time()
        await client.aclose()
    # The heartbeat at 15 s is the first write nobody takes; it is given up send_timeout_s later.
    assert given_up_at == pytest.approx(15 + 60)
    assert not runner.completed


async def test_empty_batch_is_answered_at_once(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    host = make_host(runner)
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        reply = await exchange(client, request_bytes({"examples": []}))
    assert reply.json()["results"] == []
    assert not reply.heartbeat_times


async def test_http_10_caller_gets_503_when_the_host_shuts_down(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = make_host(runner)
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        await client.send_all(request_bytes(episodes(2, meetings=3, think_s=100), version="1.0"))
        await runner.wait_for(lambda r: len(r.started) == 2)
        host.request_shutdown()
        reply = await read_reply(client)
    assert reply.status == 503 and reply.framing == "content-length"
    assert reply.json()["error"]["code"] == "shutting_down"
    assert len(runner.cancelled) == 2
