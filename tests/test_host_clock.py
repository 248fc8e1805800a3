"""Timing rules on a virtual clock over in-memory streams: heartbeats, deadlines, departures.

``autojump_clock`` jumps whenever every task waits, so a 30-minute batch runs in milliseconds
and every time below is exact.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from tests.helpers import CountingRunner, exchange, read_reply, request_bytes
from trio_gym.config import ServeConfig
from trio_gym.host import Host, handle_connection


def make_host(runner: CountingRunner, **overrides: Any) -> Host:
    return Host(ServeConfig(port=0, **overrides), runner=runner)


def open_connection(nursery: trio.Nursery, host: Host) -> trio.abc.Stream:
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


@pytest.mark.parametrize("served", [True, False], ids=["host-pacer", "batch-pacer"])
async def test_heartbeats_ride_the_hosts_pacer_or_one_the_batch_owns(
    autojump_clock: trio.abc.Clock, served: bool
) -> None:
    host = make_host(CountingRunner(), heartbeat_interval_s=10)
    on_host_pacer: list[float] = []
    start_every = host.services.pacer.start_every

    def record(interval_s: float, call: Any) -> Any:
        on_host_pacer.append(interval_s)
        return start_every(interval_s, call)

    host.services.pacer.start_every = record  # type: ignore[method-assign]
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        if served:  # as serve runs it, for every connection of the host
            await nursery.start(host.services.pacer.run)
        client = open_connection(nursery, host)
        reply = await exchange(client, request_bytes(episodes(1, meetings=2, think_s=24)))
        nursery.cancel_scope.cancel()
    assert [at - start for at in reply.heartbeat_times] == [10, 20, 30, 40]
    assert on_host_pacer == ([10] if served else [])


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
    assert host.services.stats.examples_cancelled == 5 and host.services.stats.examples_running == 0


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
    assert host.services.stats.examples_running == 0 and host.services.stats.batches_running == 0


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
        host.lifecycle.request_shutdown()
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
    client, server = trio.testing.lockstep_stream_pair()  # one byte in flight, as a full socket
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(handle_connection, host, server, buffer_bytes=1))
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
        host.lifecycle.request_shutdown()
        reply = await read_reply(client)
    assert reply.status == 503 and reply.framing == "content-length"
    assert reply.json()["error"]["code"] == "shutting_down"
    assert len(runner.cancelled) == 2


class NurseryRunner:
    """A runner with a nursery of its own: cancelled, it ends with a group of Cancelled."""

    def check_example(self, example: Any) -> None:
        pass

    async def run_example(self, example: Any, context: Any) -> Any:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep, 1000)
            nursery.start_soon(trio.sleep, 1000)
        return {}


async def test_examples_of_a_runner_with_its_own_nursery_are_counted(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner(NurseryRunner())
    host = Host(ServeConfig(port=0, rollout_deadline_s=10), runner=runner)
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        reply = await exchange(client, request_bytes({"examples": [{}, {}]}))
    assert reply.json()["error"]["code"] == "deadline_exceeded"
    assert len(runner.cancelled) == 2
    assert host.services.stats.examples_cancelled == 2 and host.services.stats.examples_running == 0


async def test_a_cancelled_connection_gives_back_its_slot(autojump_clock: trio.abc.Clock) -> None:
    host = make_host(CountingRunner(), max_connections=2)
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            client = open_connection(nursery, host)
            await client.send_all(b"POST /rollouts/run HTTP/1.1\r\n")  # a head still arriving
        await trio.sleep(1)
        assert host.services.stats.connections_open == 2
        nursery.cancel_scope.cancel()
    assert host.services.stats.connections_open == 0
    assert host.admission.served.slots.borrowed_tokens == 0


async def test_beyond_the_cap_a_bounded_overflow_hears_503_and_the_rest_are_closed(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = make_host(CountingRunner(), max_connections=1, read_timeout_s=30)
    overflow = host.admission.refused.slots.total_tokens
    async with trio.open_nursery() as nursery:

        async def connect() -> Any:
            stream = open_connection(nursery, host)
            await trio.sleep(0.001)  # admitted in order: each handler runs before the next
            return stream

        start = trio.current_time()
        holder = await connect()  # takes the only full slot and sends nothing
        silent = [await connect() for _ in range(overflow)]
        dropped = await connect()
        opened = trio.current_time()
        dropped_reply = await read_reply(dropped)
        assert trio.current_time() == opened  # closed at once, nothing read or written
        busy_replies = [await read_reply(stream) for stream in silent]
        holder_reply = await read_reply(holder)
    assert not dropped_reply.status and not dropped_reply.complete
    assert {reply.status for reply in busy_replies} == {503}
    assert {reply.json()["error"]["code"] for reply in busy_replies} == {"host_busy"}
    assert all(reply.head_at - start < 3 for reply in busy_replies)  # the 2 s refusal timeout
    assert holder_reply.status == 408 and holder_reply.head_at - start == 30


async def test_a_trickled_body_gets_408_once_it_falls_below_the_minimum_rate(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = make_host(runner, read_timeout_s=30)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        await client.send_all(request_bytes(b"x" * 100_000)[:-100_000])  # the head alone

        async def trickle() -> None:
            for _ in range(100):
                await trio.sleep(29)  # always inside the 30 s idle timeout
                await client.send_all(b"x")

        nursery.start_soon(trickle)
        reply = await read_reply(client)
        nursery.cancel_scope.cancel()
    assert reply.status == 408
    assert "slower than 8192 bytes/s" in reply.json()["error"]["message"]
    assert reply.head_at - start < 31  # 30 s of grace plus 1/8192 s per byte received
    assert not runner.started


async def test_the_host_is_checked_ready_before_the_body_is_read(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = Host(ServeConfig(port=0))  # never bootstrapped: still starting
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        await client.send_all(request_bytes(b"x" * 1000)[:-1000])  # no body will come
        reply = await read_reply(client)
    assert reply.status == 503 and reply.json()["error"]["code"] == "not_ready"
    assert reply.head_at == start


async def test_a_shutdown_while_the_body_arrives_refuses_the_batch(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = make_host(runner)
    body = json.dumps(episodes(2, meetings=3, think_s=1)).encode()
    request = request_bytes(body)
    async with trio.open_nursery() as nursery:
        client = open_connection(nursery, host)
        await client.send_all(request[:-10])
        await trio.sleep(5)
        host.lifecycle.request_shutdown()
        await client.send_all(request[-10:])
        reply = await read_reply(client)
    assert reply.status == 503 and reply.json()["error"]["code"] == "shutting_down"
    assert not runner.started


async def test_a_short_batch_is_one_log_line_and_a_lasting_one_two(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch's running line is written once it has lasted WATCH_AFTER_S; a batch over by then
    is one line, its end, carrying what the running line would have said."""
    caplog.set_level(logging.INFO, logger="trio_gym")
    host = make_host(CountingRunner(), heartbeat_interval_s=15)
    lines: dict[float, list[tuple[str, dict[str, Any]]]] = {}
    for think_s in (0.0, 1.0):
        caplog.clear()
        async with trio.open_nursery() as nursery:
            reply = await exchange(
                open_connection(nursery, host),
                request_bytes(episodes(1, meetings=1, think_s=think_s)),
            )
        assert reply.status == 200 and reply.complete
        lines[think_s] = [
            (record.getMessage(), getattr(record, "trio_gym_fields", {}))
            for record in caplog.records
            if record.getMessage().startswith("batch_")
        ]
    [(short_event, short_fields)] = lines[0.0]
    assert short_event == "batch_done" and short_fields["mode"] == "document"
    (running, running_fields), (done, done_fields) = lines[1.0]
    assert (running, done) == ("batch_running", "batch_done")
    assert running_fields["mode"] == "document" and "mode" not in done_fields
