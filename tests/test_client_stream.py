"""`client.stream(examples)`: rows as they finish, sidecar errors, the done line, cut streams."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tests.canned import CannedHost, chunked_response, json_response, respond
from tests.helpers import URL, CountingRunner, in_memory
from trio_gym.config import ServeConfig
from trio_gym.host import Host
from trio_gym.trainer import ClientSettings, Origin, RolloutClient, RolloutError, Row, StreamSummary
from trio_gym.trainer.errors import Reach


async def collect(client: RolloutClient, examples: list[dict[str, Any]]) -> tuple[list[Row], Any]:
    rows = []
    async with client.stream(examples) as stream:
        async for row in stream:
            rows.append((trio.current_time(), row))
    return rows, stream


async def test_rows_arrive_in_completion_order_with_a_summary(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = Host(ServeConfig(port=0, heartbeat_interval_s=10), runner=CountingRunner())
    examples = [
        {"seed": i, "meetings": 2, "think_s": 30 - 10 * i, "_ng_task_index": i} for i in range(3)
    ]
    async with trio.open_nursery() as nursery:
        client = RolloutClient(URL, opener=in_memory(nursery, host))
        start = trio.current_time()
        rows, stream = await collect(client, examples)
    assert [(at - start, row.index) for at, row in rows] == [(20, 2), (40, 1), (60, 0)]
    assert all(row.ok and row.result["_ng_task_index"] == row.index for _, row in rows)
    assert stream.summary == StreamSummary(completed=3, failed=0)
    assert stream.heartbeats in (5, 6)  # empty lines at 10, ..., 50 s; 60 ties with the end
    assert stream.missing == []


async def test_a_failed_example_is_a_row_with_an_error(autojump_clock: trio.abc.Clock) -> None:
    host = Host(ServeConfig(port=0), runner=CountingRunner())
    examples = [{"seed": 0, "think_s": 5}, {"seed": 1, "fail_at_step": 0}]
    async with trio.open_nursery() as nursery:
        rows, stream = await collect(RolloutClient(URL, opener=in_memory(nursery, host)), examples)
    failed = next(row for _, row in rows if row.index == 1)
    assert not failed.ok and failed.error is not None and failed.error.code == "internal"
    assert stream.summary == StreamSummary(completed=1, failed=1)


async def test_a_deadline_ends_the_stream_with_a_sandbox_error_after_the_rows(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = Host(ServeConfig(port=0, rollout_deadline_s=50), runner=CountingRunner())
    examples = [{"seed": 0, "think_s": 1}, {"seed": 1, "think_s": 100}]
    seen = []
    async with trio.open_nursery() as nursery:
        client = RolloutClient(URL, opener=in_memory(nursery, host))
        with pytest.raises(RolloutError) as failure:
            async with client.stream(examples) as stream:
                async for row in stream:
                    seen.append(row.index)
    assert seen == [0]
    assert failure.value.origin is Origin.SANDBOX and failure.value.code == "deadline_exceeded"
    assert stream.missing == [1]


HEALTH_READY = json_response(200, b'{"status": "ready"}')


@pytest.mark.parametrize("framed_end", [False, True], ids=["cut-mid-body", "ended-cleanly"])
@pytest.mark.parametrize(
    ("health", "origin"),
    [(None, Origin.SANDBOX), (HEALTH_READY, Origin.PROXY)],
    ids=["host-gone", "host-alive"],
)
async def test_a_stream_cut_before_its_done_line_is_named_as_run_names_a_cut_and_taken(
    framed_end: bool, health: bytes | None, origin: Origin
) -> None:
    """A proxy that ends a cut body cleanly (OpenSandbox's does) and a connection that dies
    are the same event: the host's /health names it, as for a document."""
    cut = chunked_response(b"\n", b'{"index": 0, "result": {"ok": true}}\n', end=framed_end)
    probe = CannedHost.REFUSE if health is None else respond(health)
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(cut), probe])
        once = ClientSettings(max_reattaches=0)  # a scripted host keeps no answer to reattach to
        client = RolloutClient(URL, once, opener=canned.open)
        seen = []
        with pytest.raises(RolloutError) as failure:
            async for row in client.stream([{"a": 1}, {"a": 2}]):
                seen.append(row.index)
        document = CannedHost(nursery, [respond(chunked_response(b" ", end=framed_end)), probe])
        with pytest.raises(RolloutError) as run_failure:
            await RolloutClient(URL, once, opener=document.open).run([{"a": 1}])
    assert seen == [0]
    assert (failure.value.origin, failure.value.reach) == (origin, Reach.TAKEN)
    assert (run_failure.value.origin, run_failure.value.reach) == (origin, Reach.TAKEN)
    assert failure.value.suspect and run_failure.value.suspect
    assert "1 of 2 example(s) got no row" in failure.value.message


async def test_a_refusal_is_classified_like_a_document() -> None:
    async with trio.open_nursery() as nursery:
        host = Host(ServeConfig(port=0))  # never started: 503 not_ready
        client = RolloutClient(URL, opener=in_memory(nursery, host))
        with pytest.raises(RolloutError) as failure:
            await collect(client, [{"seed": 1}])
    assert failure.value.origin is Origin.SANDBOX and failure.value.code == "not_ready"


async def test_leaving_the_stream_early_cancels_the_rest_on_the_host(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    host = Host(ServeConfig(port=0), runner=runner)
    examples = [
        {"seed": 0, "think_s": 1},
        {"seed": 1, "think_s": 1000},
        {"seed": 2, "think_s": 1000},
    ]
    async with trio.open_nursery() as nursery:
        client = RolloutClient(URL, opener=in_memory(nursery, host))
        async with client.stream(examples) as stream:
            async for row in stream:
                assert row.index == 0
                break
        with trio.fail_after(100):
            await runner.wait_for(lambda r: len(r.cancelled) == 2)
    assert sorted(index for index, _ in runner.cancelled) == [1, 2]


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        ([b'{"index": 0, "result": 1}\n', b'{"index": 0, "result": 2}\n'], "a second row"),
        ([b'{"index": true, "result": 1}\n'], "index out of range"),
        (
            [b'{"index": 0, "result": 1}\n', b'{"done": true, "completed": 2, "failed": 0}\n'],
            "after 1 rows",
        ),
        (
            [b'{"index": 0, "result": 1}\n', b'{"done": true, "completed": "n/a"}\n'],
            "without counts",
        ),
        ([b"[" * 100_000 + b"\n"], "not JSON"),
    ],
    ids=["duplicate", "bool-index", "wrong-count", "no-counts", "deep"],
)
async def test_rows_that_break_the_contract_are_sandbox_failures(
    lines: list[bytes], fragment: str
) -> None:
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(chunked_response(*lines))])
        with pytest.raises(RolloutError) as failure:
            await collect(RolloutClient(URL, opener=canned.open), [{"a": 1}, {"a": 2}])
    assert failure.value.origin is Origin.SANDBOX and fragment in failure.value.message


async def test_a_line_longer_than_the_limit_is_refused_without_buffering_it_all() -> None:
    endless = chunked_response(b"x" * 65536, b"x" * 65536, b"x" * 65536, end=False)
    async with trio.open_nursery() as nursery:
        canned = CannedHost(nursery, [respond(endless)])
        client = RolloutClient(URL, ClientSettings(max_response_bytes=100_000), opener=canned.open)
        with pytest.raises(RolloutError, match="longer than max_response_bytes"):
            await collect(client, [{"a": 1}])


async def test_the_client_deadline_bounds_a_row_stream_that_never_ends(
    autojump_clock: trio.abc.Clock,
) -> None:
    host = Host(ServeConfig(port=0, rollout_deadline_s=10**6), runner=CountingRunner())
    async with trio.open_nursery() as nursery:
        settings = ClientSettings(request_deadline_s=100)
        client = RolloutClient(URL, settings, opener=in_memory(nursery, host))
        start = trio.current_time()
        with pytest.raises(RolloutError, match="no done line within 100 s") as failure:
            await collect(client, [{"seed": 1, "meetings": 12, "think_s": 3600}])
        assert trio.current_time() - start == 100
    assert (failure.value.origin, failure.value.reach) == (Origin.PROXY, Reach.TAKEN)
