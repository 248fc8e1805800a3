"""Reattach by ``Idempotency-Key`` on the host: on a virtual clock over in-memory streams, every
time exact."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from tests.helpers import (
    CountingRunner,
    Reply,
    exchange,
    read_reply,
    request_bytes,
    running_host,
    tcp_exchange,
)
from trio_gym.config import ServeConfig
from trio_gym.host import Host, handle_connection
from trio_gym.host.reattach import ANSWER_OVERHEAD_BYTES
from trio_gym.host.rollouts import THREAD_PARSE_BYTES
from trio_gym.http.h11_build import h11
from trio_gym.runners import ExampleRunner, Runner
from trio_gym.trainer import ClientSettings, RolloutClient

KEY = "chunk-7f3a"
HANG_GUARD_S = 30  # only a guard against a hang on the real clock


def batch(count: int = 2, *, meetings: int = 3, think_s: float = 100) -> dict[str, Any]:
    return {
        "examples": [{"seed": i, "meetings": meetings, "think_s": think_s} for i in range(count)]
    }


def keyed(body: dict[str, Any], key: str = KEY, *, rows: bool = False) -> bytes:
    headers = [("Idempotency-Key", key)]
    if rows:
        headers.append(("Accept", "application/x-ndjson"))
    return request_bytes(body, headers=headers)


@asynccontextmanager
async def keyed_host(runner: Runner, **config: Any) -> AsyncIterator[Any]:
    host = Host(ServeConfig(port=0, heartbeat_interval_s=15, **config), runner=runner)
    async with trio.open_nursery() as nursery:

        def connect() -> trio.abc.Stream:
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(handle_connection, host, server)
            return client

        yield host, connect
        nursery.cancel_scope.cancel()


async def test_a_second_post_with_the_same_key_attaches_and_gets_the_answer_from_its_start(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner) as (host, connect), trio.open_nursery() as nursery:
        first: list[Any] = []

        async def first_caller() -> None:
            first.append(await exchange(connect(), keyed(batch())))

        nursery.start_soon(first_caller)
        await trio.sleep(160)  # ten heartbeats in
        start = trio.current_time()
        second = await exchange(connect(), keyed(batch()))
    assert first[0].status == second.status == 200 and second.complete
    assert first[0].body == second.body  # heartbeats from the start, then the same document
    assert second.pieces[0][0] == start  # the heartbeats it missed, at once
    assert [r["seed"] for r in second.json()["results"]] == [0, 1]
    assert len(runner.started) == 2 and len(runner.completed) == 2  # ran once
    assert host.services.keyed.reattached_total == 1


async def test_a_finished_answer_is_handed_out_again_until_its_retention_then_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner, answer_retention_s=600) as (host, connect):
        answered = await exchange(connect(), keyed(batch(think_s=1)))
        await trio.sleep(599)
        again = await exchange(connect(), keyed(batch(think_s=1)))
        await trio.sleep(1)
        expired = await exchange(connect(), keyed(batch(think_s=1)))
    assert answered.body == again.body and again.complete
    assert expired.status == 410 and expired.json()["error"]["code"] == "answer_expired"
    assert KEY in expired.json()["error"]["message"]
    assert len(runner.started) == 2  # never run again under the key


async def test_finished_answers_beyond_the_bytes_kept_go_oldest_first(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    # Each kept answer counts its bytes and what keeping it costs besides.
    kept = [size + ANSWER_OVERHEAD_BYTES for size in (0, 0)]
    settings = {"answer_retention_bytes": 1000 + sum(kept), "reattach_grace_s": 5}
    async with keyed_host(runner, **settings) as (host, connect):
        sizes = []
        for key in ("k1", "k2", "k3"):
            sizes.append(len((await exchange(connect(), keyed(batch(think_s=1), key))).body))
            await trio.sleep(5)  # past the grace: no caller may be coming back for it
        assert min(sizes) > 400 and sum(sizes[1:]) <= 1000 < sum(sizes)
        oldest = await exchange(connect(), keyed(batch(think_s=1), "k1"))
        newest = await exchange(connect(), keyed(batch(think_s=1), "k3"))
    assert oldest.status == 410 and newest.status == 200
    assert len(runner.started) == 6


async def test_the_same_key_with_another_body_is_refused_naming_the_key(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner) as (host, connect), trio.open_nursery() as nursery:
        nursery.start_soon(exchange, connect(), keyed(batch()))
        await trio.sleep(10)
        other = await exchange(connect(), keyed(batch(count=3)))
        rows = await exchange(connect(), keyed(batch(), rows=True))  # another Accept
        nursery.cancel_scope.cancel()
    for refused in (other, rows):
        assert refused.status == 422
        error = refused.json()["error"]
        assert error["code"] == "idempotency_key_reused"
        assert f"Idempotency-Key: {KEY} belongs" in error["message"]
    assert len(runner.started) == 2


async def test_an_abandoned_keyed_batch_runs_on_for_its_grace_and_a_returning_caller_gets_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner, reattach_grace_s=60) as (host, connect):
        gone = connect()
        await gone.send_all(keyed(batch(meetings=3, think_s=100), rows=True))
        await runner.wait_for(lambda r: len(r.started) == 2)
        await gone.aclose()
        await trio.sleep(59)  # within the grace: nothing cancelled
        assert not runner.cancelled
        back = await exchange(connect(), keyed(batch(meetings=3, think_s=100), rows=True))
    lines = [json.loads(line) for line in back.body.splitlines() if line.strip()]
    assert sorted(line["index"] for line in lines if "index" in line) == [0, 1]
    assert lines[-1] == {"done": True, "completed": 2, "failed": 0}
    assert len(runner.completed) == 2 and not runner.cancelled


async def test_a_keyed_batch_no_caller_comes_back_for_is_cancelled_at_its_grace(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner, reattach_grace_s=60) as (host, connect):
        gone = connect()
        await gone.send_all(keyed(batch(meetings=6, think_s=300)))
        await runner.wait_for(lambda r: len(r.started) == 2)
        await trio.sleep(100)
        left_at = trio.current_time()
        await gone.aclose()
        with trio.fail_after(1000):  # virtual seconds: a guard, not a bound
            await runner.wait_for(lambda r: len(r.cancelled) == 2)
        cancelled_after = max(at for _, at in runner.cancelled) - left_at
        late = await exchange(connect(), keyed(batch(meetings=6, think_s=300)))
    # Noticed at once (the watcher's probe meets the closed stream, long before the next
    # heartbeat 15 s on), then the grace: never before the grace.
    assert 60 <= cancelled_after < 60 + 1
    assert late.status == 410
    assert "stopped before its answer ended" in late.json()["error"]["message"]
    assert host.services.stats.batches_running == 0 and not runner.completed


async def test_an_unkeyed_batch_is_still_cancelled_at_its_callers_disconnect(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner, reattach_grace_s=60) as (host, connect):
        gone = connect()
        await gone.send_all(request_bytes(batch(meetings=6, think_s=300)))
        await runner.wait_for(lambda r: len(r.started) == 2)
        left_at = trio.current_time()
        await gone.aclose()
        with trio.fail_after(1000):  # virtual seconds: a guard, not a bound
            await runner.wait_for(lambda r: len(r.cancelled) == 2)
    assert max(at for _, at in runner.cancelled) - left_at <= 15


async def test_a_keyed_request_refused_before_it_runs_leaves_its_key_free(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner) as (host, connect):
        refused = await exchange(connect(), keyed({"examples": "not a list"}))
        stream = connect()
        await stream.send_all(keyed(batch(think_s=1)))
        answered = await read_reply(stream)
    assert refused.status == 400 and refused.json()["error"]["code"] == "invalid_request"
    assert answered.status == 200  # the key was not taken by the refusal (another body, too)


async def test_a_client_that_gives_its_request_up_has_the_batch_cancelled_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The client sends every request under a key; cancelled, it says so (DELETE under the
    key): the batch stops now, not after the grace kept for a caller that may come back."""
    runner = CountingRunner()
    async with keyed_host(runner, reattach_grace_s=600) as (host, connect):

        async def opener(endpoint: object) -> trio.abc.Stream:
            await trio.lowlevel.checkpoint()
            return connect()

        client = RolloutClient("http://host.invalid:8080", opener=opener)
        with trio.move_on_after(50):
            await client.run([{"seed": i, "meetings": 3, "think_s": 100} for i in range(2)])
        given_up_at = trio.current_time()
        with trio.fail_after(100):  # virtual seconds; the grace is 600
            await runner.wait_for(lambda r: len(r.cancelled) == 2)
        cancelled_at = max(at for _, at in runner.cancelled)
    assert cancelled_at - given_up_at < 1  # not 600 s later
    assert not runner.completed


async def test_an_answer_whose_caller_may_come_back_is_kept_over_the_bytes_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Found in review: an older answer being sent to a slow reader stays; the bound must not
    then drop the answer that just finished while its cut caller is coming back for it."""
    runner = CountingRunner()
    bound = 700 + ANSWER_OVERHEAD_BYTES
    async with keyed_host(runner, answer_retention_bytes=bound) as (host, connect):
        first = await exchange(connect(), keyed(batch(think_s=1), "k1"))
        assert first.status == 200 and 400 < len(first.body) < 700
        slow_client, slow_server = trio.testing.lockstep_stream_pair()  # reads nothing: k1 pinned
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(handle_connection, host, slow_server, buffer_bytes=1))
            await slow_client.send_all(keyed(batch(think_s=1), "k1"))
            cut = connect()
            await cut.send_all(keyed(batch(think_s=10, meetings=1), "k2"))
            await trio.sleep(1)
            await cut.aclose()  # k2's caller is cut while k2 runs
            await trio.sleep(30)  # k2 finished meanwhile, within the grace (60 s)
            back = await exchange(connect(), keyed(batch(think_s=10, meetings=1), "k2"))
            nursery.cancel_scope.cancel()
    assert back.status == 200 and back.complete
    assert len(runner.completed) == 4  # k1's two and k2's two, once each


async def test_a_request_given_up_before_it_arrives_is_refused_when_it_does(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A DELETE that finds nothing under its key remembers it: the POST still on its way (a
    proxy held it) is refused, never run."""
    runner = CountingRunner()
    async with keyed_host(runner) as (host, connect):
        gone = await exchange(
            connect(), request_bytes(method="DELETE", headers=[("Idempotency-Key", KEY)])
        )
        late = await exchange(connect(), keyed(batch(think_s=1)))
    assert gone.status == 200 and gone.json() == {"key": KEY, "cancelled": False}
    assert late.status == 410 and "gave it up" in late.json()["error"]["message"]
    assert not runner.started


class HeadSwallowing(trio.abc.Stream):
    """The request goes through; nothing comes back (a proxy that holds the answer)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_request_whose_head_never_came_is_dropped_on_the_host_before_it_goes_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Found in review: the host keeps a keyed batch for its caller's return, so a request
    with no head back is sent again only once the host confirms (DELETE) it dropped the first;
    each example then runs to its end once."""
    runner = CountingRunner()
    async with keyed_host(runner, reattach_grace_s=60) as (host, connect):
        opened = 0

        async def opener(endpoint: object) -> trio.abc.Stream:
            nonlocal opened
            await trio.lowlevel.checkpoint()
            opened += 1
            return HeadSwallowing(connect()) if opened == 1 else connect()

        settings = ClientSettings(head_timeout_s=5)
        client = RolloutClient("http://host.invalid:8080", settings, opener=opener)
        results = await client.run([{"seed": i, "meetings": 2, "think_s": 5} for i in range(2)])
        await trio.sleep(120)
    assert len(results) == 2
    assert len(runner.completed) == 2 and len(runner.cancelled) == 2  # the first copy, dropped


async def test_a_bug_in_a_keyed_batch_is_a_500_and_the_host_lives() -> None:
    """Found in review: keyed batches run outside their connection; the host's boundary for a
    bug must hold for them too (real sockets, real clock)."""
    async with running_host(runner=BuggyRunner()) as (host, port):
        with trio.fail_after(10):
            reply = await tcp_exchange(port, keyed({"examples": [{"bug": True}]}, "k-bug"))
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
    assert reply.status == 500 and reply.json()["error"]["code"] == "internal"
    assert health.status == 200


class BuggyRunner(ExampleRunner):
    def check_example(self, example: Mapping[str, Any]) -> None:
        if example.get("bug"):
            raise TypeError("a bug in user code")
        super().check_example(example)


async def test_keyed_batches_whose_callers_hung_up_after_the_head_never_run_more_than_the_limit(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Found by an adversarial run: 100 keyed POSTs each closed after its head all ran on at
    once under a cap of 16 connections. The batch limit counts batches, attached or not."""
    runner = CountingRunner()
    statuses = []
    async with keyed_host(runner, max_batches=16, reattach_grace_s=60) as (host, connect):
        for n in range(100):
            stream = connect()
            await stream.send_all(keyed(batch(count=1, think_s=100), f"hung-up-{n}"))
            statuses.append((await read_head(stream)).status)
            await stream.aclose()
            await trio.sleep(0.03)
        await trio.sleep(1)  # each caller's watcher has found it gone; the grace runs on
        assert host.services.stats.batches_running == 16
        assert host.services.stats.connections_open == 0  # the sockets are gone, the work is not
    assert statuses.count(200) == 16 and statuses.count(503) == 84
    assert runner.peak == 16


async def read_head(stream: trio.abc.Stream) -> Reply:
    """The status line and headers of an answer, and nothing more."""
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method="POST", target="/", headers=[("host", "test")]))
    while True:
        event = parser.next_event()
        if isinstance(event, h11.Response):
            return Reply(status=event.status_code)
        if isinstance(event, h11.ConnectionClosed):
            return Reply()  # closed without an answer: status 0
        parser.receive_data(bytes(await stream.receive_some(65536)))


async def test_health_says_busy_while_every_batch_that_may_run_runs(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner, max_batches=1) as (host, connect), trio.open_nursery() as nursery:
        nursery.start_soon(exchange, connect(), request_bytes(batch(count=1, think_s=10)))
        await runner.wait_for(lambda r: len(r.started) == 1)
        health = await exchange(connect(), request_bytes(method="GET", target="/health"))
        with trio.fail_after(1000):  # virtual seconds: a guard, not a bound
            refused = await exchange(connect(), keyed(batch(count=1, think_s=1)))
            await runner.wait_for(lambda r: len(r.completed) >= 1)
        await trio.sleep(1)
        ready = await exchange(connect(), request_bytes(method="GET", target="/health"))
        taken = await exchange(connect(), keyed(batch(count=1, think_s=1)))
    assert health.status == 503 and health.headers["retry-after"] == "1"
    assert health.json()["error"]["code"] == "host_busy"
    assert refused.status == 503 and "max_batches" in refused.json()["error"]["message"]
    assert ready.status == 200 and taken.status == 200  # the refused key was left free


async def test_every_line_of_a_keyed_batch_names_its_batch_and_key_until_its_one_end(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in review: a keyed batch cancelled by DELETE logged its key and never again its
    batch id. Given up, it ends as a batch whose caller left does, saying why."""
    caplog.set_level(logging.DEBUG, logger="trio_gym")
    runner = CountingRunner()
    async with keyed_host(runner, reattach_grace_s=600) as (host, connect):
        gone = connect()
        await gone.send_all(keyed(batch(think_s=100)))
        await trio.sleep(1)
        await gone.aclose()
        await trio.sleep(1)  # its watcher finds the caller gone
        back = connect()
        await back.send_all(keyed(batch(think_s=100)))
        await trio.sleep(1)
        await back.aclose()
        await trio.sleep(1)
        delete = request_bytes(method="DELETE", headers=[("Idempotency-Key", KEY)])
        given_up = await exchange(connect(), delete)
        await runner.wait_for(lambda r: len(r.cancelled) == 2)
        await trio.sleep(1)
    lines = [
        (record.getMessage(), getattr(record, "trio_gym_fields", {}))
        for record in caplog.records
        if record.getMessage().startswith(("batch_", "keyed_"))
    ]
    assert given_up.json() == {"key": KEY, "cancelled": True}
    assert [event for event, _ in lines] == [
        "batch_running",
        "keyed_caller_left",
        "keyed_batch_attached",
        "keyed_caller_left",
        "batch_abandoned",
    ]
    batch_ids = {fields.get("batch") for _, fields in lines}
    assert len(batch_ids) == 1 and None not in batch_ids
    assert all(fields.get("key") == KEY for _, fields in lines)
    assert "gave it up" in lines[-1][1]["reason"]
    assert host.services.stats.batches_finished["caller_gone"] == 1


@pytest.mark.parametrize("rows", [False, True], ids=["document", "rows"])
async def test_a_half_closed_keyed_caller_is_still_attached_and_gets_its_whole_answer(
    rows: bool,
) -> None:
    """Real sockets, real clock: a caller that shuts down its sending side after the request
    is still there (its watcher's probes are taken), so the grace never starts; the probes are
    the answer's own heartbeat, which its reader skips (an empty line in a row stream)."""
    runner = CountingRunner()
    async with running_host(runner=runner, reattach_grace_s=0.3) as (host, port):
        with trio.fail_after(30):  # a guard, not a bound
            request = keyed(batch(meetings=3, think_s=0.5), rows=rows)
            reply = await tcp_exchange(port, request, half_close=True)
    assert reply.status == 200 and reply.complete and not runner.cancelled
    if rows:
        lines = [json.loads(line) for line in reply.body.split(b"\n") if line]
        assert lines[-1] == {"done": True, "completed": 2, "failed": 0}
    else:
        assert len(reply.json()["results"]) == 2


async def test_a_delete_gives_a_batch_up_at_once_even_while_a_caller_reads_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The caller that gave the batch up is the one whose word counts: another still reading
    it (a copy of the trainer that lost track) is cut, never answered as if whole."""
    runner = CountingRunner()
    async with keyed_host(runner, reattach_grace_s=600) as (host, connect):
        reading = connect()
        await reading.send_all(keyed(batch(think_s=100)))
        await runner.wait_for(lambda r: len(r.started) == 2)
        given_up_at = trio.current_time()
        delete = request_bytes(method="DELETE", headers=[("Idempotency-Key", KEY)])
        given_up = await exchange(connect(), delete)
        with trio.fail_after(100):  # virtual seconds: a guard, not a bound
            await runner.wait_for(lambda r: len(r.cancelled) == 2)
            with pytest.raises(h11.RemoteProtocolError, match="incomplete chunked read"):
                await read_reply(reading)  # cut, never ended as if whole
    assert given_up.json() == {"key": KEY, "cancelled": True}
    assert max(at for _, at in runner.cancelled) - given_up_at < 1


class HeldCheck(ExampleRunner):
    """Its check of an example waits (in the worker thread a large body is checked in) until
    the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def check_example(self, example: Mapping[str, Any]) -> None:
        self.entered.set()
        self.release.wait(timeout=HANG_GUARD_S)


async def test_a_delete_while_the_body_is_still_checked_keeps_the_batch_from_ever_running() -> None:
    """Found in review: a DELETE answered "cancelled" before the batch was admitted let it run
    (or, refused busy, freed its key). On the real clock: the check runs in a worker thread."""
    held = HeldCheck()
    runner = CountingRunner(held)
    big = {"examples": [{"seed": 1, "meetings": 1, "pad": "x" * (THREAD_PARSE_BYTES + 1)}]}
    delete = request_bytes(method="DELETE", headers=[("Idempotency-Key", KEY)])
    async with keyed_host(runner) as (host, connect), trio.open_nursery() as nursery:
        with trio.fail_after(HANG_GUARD_S):
            first: list[Reply] = []

            async def post_first() -> None:
                first.append(await exchange(connect(), keyed(big)))

            nursery.start_soon(post_first)
            await trio.to_thread.run_sync(held.entered.wait)
            given_up = await exchange(connect(), delete)
            held.release.set()
            while not first:  # noqa: ASYNC110 (the other task's answer is the event)
                await trio.sleep(0.01)
            again = await exchange(connect(), keyed(big))
    assert given_up.json() == {"key": KEY, "cancelled": True}
    assert first[0].status == 410 and "gave it up" in first[0].json()["error"]["message"]
    assert again.status == 410
    assert not runner.started


class BrokenDelivery(ExampleRunner):
    """A bug that surfaces only once the answer is whole: the delivery callback raises."""

    async def run_example(self, example: Mapping[str, Any], context: Any) -> Any:
        result = await super().run_example(example, context)
        context.when_delivered(self._explode)
        return result

    def _explode(self) -> None:
        raise RuntimeError("a bug after the answer")


async def test_a_bug_after_a_keyed_answer_ended_still_delivers_it_and_keeps_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Found in review: the bug cut the first caller's whole answer, and the batch was never
    filed among the finished (kept forever, outside every bound)."""
    async with keyed_host(BrokenDelivery(), answer_retention_s=10) as (host, connect):
        first = await exchange(connect(), keyed(batch(count=1, think_s=1)))
        again = await exchange(connect(), keyed(batch(count=1, think_s=1)))
        await trio.sleep(20)
        expired = await exchange(connect(), keyed(batch(count=1, think_s=1)))
    assert first.status == 200 and first.complete and len(first.json()["results"]) == 1
    assert again.body == first.body
    assert expired.status == 410


async def test_a_keyed_batch_of_no_examples_is_answered_and_not_kept(
    autojump_clock: trio.abc.Clock,
) -> None:
    """It ran nothing: a flood of them must not fill the answers kept or the keys remembered."""
    runner = CountingRunner()
    async with keyed_host(runner) as (host, connect):
        answers = [await exchange(connect(), keyed({"examples": []}, f"e{n}")) for n in range(3)]
        again = await exchange(connect(), keyed({"examples": []}, "e0"))
    assert [answer.status for answer in [*answers, again]] == [200] * 4
    assert again.json()["results"] == []
    assert len(host.services.keyed.memory.ran) == 0 and host.services.keyed.find("e1", "") is None
