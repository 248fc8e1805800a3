"""The per-row NDJSON answer, on a virtual clock over memory streams."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import trio
import trio.testing

from tests.helpers import CountingRunner, ScriptedRunner, exchange, request_bytes
from trio_gym.config import ServeConfig
from trio_gym.host import Host, handle_connection

ROWS = [("Accept", "application/x-ndjson")]


def lines_of(body: bytes) -> list[Any]:
    return [json.loads(line) for line in body.split(b"\n") if line]


async def stream(host: Host, request: dict[str, Any], **kwargs: Any) -> Any:
    async with trio.open_nursery() as nursery:
        client, server = trio.testing.memory_stream_pair()
        nursery.start_soon(handle_connection, host, server)
        return await exchange(client, request_bytes(request, headers=ROWS, **kwargs))


async def test_rows_come_in_completion_order_with_empty_line_heartbeats(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0, heartbeat_interval_s=15), runner=runner)
    start = trio.current_time()
    examples = [
        {"seed": 0, "meetings": 3, "think_s": 20, "_ng_task_index": 0},  # ends at 60 s
        {"seed": 1, "meetings": 3, "think_s": 5, "_ng_task_index": 1},  # ends at 15 s... a tie
        {"seed": 2, "meetings": 2, "think_s": 7, "_ng_task_index": 2},  # ends at 14 s
    ]
    reply = await stream(host, {"examples": examples})
    assert reply.status == 200
    assert reply.headers["content-type"] == "application/x-ndjson"
    assert reply.framing == "chunked"
    rows = [(at - start, json.loads(data)) for at, data in reply.pieces if data.strip()]
    assert [row["index"] for _, row in rows[:3]] == [2, 1, 0]
    assert [at for at, _ in rows[:3]] == [14, 15, 60]
    assert rows[0][1]["result"]["_ng_task_index"] == 2  # identity keys carried, as in documents
    assert rows[-1] == (60, {"done": True, "completed": 3, "failed": 0})
    beats = [at - start for at, data in reply.pieces if data == b"\n"]
    assert beats[:3] == [15, 30, 45]  # 60 would tie with the end: not asserted


async def test_a_failed_example_is_a_sidecar_row_and_the_stream_goes_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0), runner=runner)
    examples = [
        {"seed": 0, "think_s": 10},
        {"seed": 1, "fail_at_step": 0},
        {"seed": 2, "think_s": 10},
    ]
    reply = await stream(host, {"examples": examples})
    rows = lines_of(reply.body)
    sidecar = next(row for row in rows if row.get("index") == 1)
    assert sidecar["error"]["code"] == "internal"
    assert sidecar["error"]["message"].startswith("example 1 failed: EnvironmentFault")
    assert {row["index"] for row in rows if "result" in row} == {0, 2}
    assert rows[-1] == {"done": True, "completed": 2, "failed": 1}
    assert not runner.cancelled  # the failure cancelled nothing else


async def test_a_batch_stopped_by_its_deadline_ends_with_an_error_done_line(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0), runner=runner)
    examples = [{"seed": 0, "think_s": 1}, {"seed": 1, "think_s": 100}]
    reply = await stream(host, {"examples": examples, "deadline_s": 50})
    rows = lines_of(reply.body)
    assert [row["index"] for row in rows if "index" in row] == [0]  # the other never finished
    assert rows[-1]["done"] is True and rows[-1]["error"]["code"] == "deadline_exceeded"
    assert [index for index, _ in runner.cancelled] == [1]


async def test_a_caller_that_stops_reading_cancels_the_rest(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0, heartbeat_interval_s=1000, send_timeout_s=30), runner=runner)
    client, server = trio.testing.lockstep_stream_pair()  # one byte in flight, as a full socket
    examples = [{"seed": i, "meetings": 1, "think_s": 10 if i == 0 else 1000} for i in range(4)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(handle_connection, host, server, buffer_bytes=1))
        await client.send_all(request_bytes({"examples": examples}, headers=ROWS))
        head = b""
        while not head.endswith(b"\r\n\r\n"):  # the head, then nothing more
            head += await client.receive_some(1)
        with trio.fail_after(500):  # virtual seconds: a guard, never reached when the rule holds
            await runner.wait_for(lambda r: len(r.cancelled) == 3)
        stopped_at = trio.current_time()
        await client.aclose()
    # The first row (at 10 s) is never taken; 30 s later the caller is given up.
    assert stopped_at == 40
    assert [index for index, _ in runner.completed] == [0]
    assert sorted(index for index, _ in runner.cancelled) == [1, 2, 3]


async def test_rows_over_http_10_are_refused_406(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0), runner=runner)
    reply = await stream(host, {"examples": [{"seed": 1}]}, version="1.0")
    assert reply.status == 406 and reply.json()["error"]["code"] == "not_acceptable"
    assert not runner.started


async def test_accept_with_parameters_and_alternatives_selects_rows(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = Host(ServeConfig(port=0), runner=CountingRunner())
    async with trio.open_nursery() as nursery:
        client, server = trio.testing.memory_stream_pair()
        nursery.start_soon(handle_connection, host, server)
        headers = [("Accept", "application/json;q=0.5, Application/X-NDJSON; q=1")]
        reply = await exchange(client, request_bytes({"examples": [{"seed": 1}]}, headers=headers))
    assert reply.headers["content-type"] == "application/x-ndjson"


async def test_big_rows_finishing_together_are_never_interleaved(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = Host(ServeConfig(port=0, heartbeat_interval_s=1), runner=ScriptedRunner())
    big = "x" * (600 * 1024)  # each row is more than two 256 KiB pieces
    examples = [{"sleep_s": 3, "result": {"blob": big, "n": i}} for i in range(3)]
    reply = await stream(host, {"examples": examples})
    lines = lines_of(reply.body)  # raises if any line was cut by another write
    assert sorted(line["result"]["n"] for line in lines if "result" in line) == [0, 1, 2]
    assert lines[-1] == {"done": True, "completed": 3, "failed": 0}


async def test_a_row_finished_before_the_deadline_is_delivered_to_a_slow_reader(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0, heartbeat_interval_s=5), runner=runner)
    client, server = trio.testing.lockstep_stream_pair()  # one byte in flight, as a full socket
    examples = [
        {"seed": 0, "meetings": 1, "think_s": 10},
        {"seed": 1, "meetings": 1, "think_s": 100},
    ]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(handle_connection, host, server, buffer_bytes=1))
        await client.send_all(request_bytes({"examples": examples, "deadline_s": 12}, headers=ROWS))
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += await client.receive_some(1)
        await trio.sleep(20)  # a slow reader: the heartbeat at 5 s and the row at 10 s wait
        reply = await read_reply_after_head(client)
    rows = lines_of(reply)
    assert [row["index"] for row in rows if "index" in row] == [0]
    assert rows[-1]["error"]["code"] == "deadline_exceeded"


async def read_reply_after_head(stream: trio.abc.ReceiveStream) -> bytes:
    """The chunked body after an already-read head, de-chunked by hand."""
    raw = b""
    while not raw.endswith(b"0\r\n\r\n"):
        raw += await stream.receive_some(65536)
    body, rest = b"", raw
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2 :]
