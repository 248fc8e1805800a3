"""Reattach over real processes and sockets: a host launched as `trio-gym serve`, behind a proxy
that ends a taken chunk's answer early and cleanly. The client asks the host whether it lives,
sends the request again under its ``Idempotency-Key`` and gets the whole answer; the host's own
record says each example ran once."""

from __future__ import annotations

import trio

from tests.cutting_proxy import CuttingProxy
from tests.processes import HANG_GUARD_S
from tests.recorded import Hosts, assert_each_ran_once, examples
from trio_gym.fleet import LocalProvider
from trio_gym.trainer import ClientSettings, RolloutClient, RolloutError
from trio_gym.trainer.errors import Reach
from trio_gym.trainer.host_client import HostClient


async def test_a_document_cut_cleanly_by_a_proxy_comes_back_whole_through_reattach(
    hosts: Hosts,
) -> None:
    provider = LocalProvider()
    with trio.fail_after(HANG_GUARD_S):
        async with provider.hosts(1, hosts.spec()) as (handle,), trio.open_nursery() as nursery:
            port = int(handle.url.rsplit(":", 1)[1])
            proxy = CuttingProxy(port, cut={0}, after_chunks=2)  # two heartbeats, then the end
            proxy_port = await nursery.start(proxy.serve)
            client = RolloutClient(
                f"http://127.0.0.1:{proxy_port}",
                ClientSettings(chunk_size=4),
                identity=handle.identity,
            )
            results = await client.run(examples(4, sleep_s=1.0))
            nursery.cancel_scope.cancel()
    assert proxy.cuts_made == 1 and proxy.posts == 2  # the cut one, and its reattach
    assert [result["id"] for result in results] == [0, 1, 2, 3]
    assert_each_ran_once(hosts, 4)
    assert hosts.left_behind() == []


async def test_a_row_stream_cut_cleanly_by_a_proxy_goes_on_from_where_it_was(
    hosts: Hosts,
) -> None:
    provider = LocalProvider()
    batch = [{"id": 0, "sleep_s": 0.05}, {"id": 1, "sleep_s": 1.5}, {"id": 2, "sleep_s": 1.5}]
    with trio.fail_after(HANG_GUARD_S):
        async with provider.hosts(1, hosts.spec()) as (handle,), trio.open_nursery() as nursery:
            port = int(handle.url.rsplit(":", 1)[1])
            proxy = CuttingProxy(port, cut={0}, after_chunks=3)  # row 0 and two heartbeats
            proxy_port = await nursery.start(proxy.serve)
            client = HostClient(f"http://127.0.0.1:{proxy_port}", identity=handle.identity)
            async with client.stream(batch) as stream:
                rows = [row async for row in stream]
            nursery.cancel_scope.cancel()
    assert stream.reattaches == 1 and proxy.cuts_made == 1
    assert sorted(row.index for row in rows) == [0, 1, 2]  # row 0 read once, not twice
    assert stream.summary is not None and stream.summary.completed == 3
    assert_each_ran_once(hosts, 3)


async def test_a_cut_when_reattaching_is_off_fails_the_chunk_named_and_runs_nothing_twice(
    hosts: Hosts,
) -> None:
    provider = LocalProvider()
    with trio.fail_after(HANG_GUARD_S):
        async with provider.hosts(1, hosts.spec()) as (handle,), trio.open_nursery() as nursery:
            port = int(handle.url.rsplit(":", 1)[1])
            proxy = CuttingProxy(port, cut={0}, after_chunks=2)
            proxy_port = await nursery.start(proxy.serve)
            settings = ClientSettings(chunk_size=4, max_reattaches=0)
            client = RolloutClient(
                f"http://127.0.0.1:{proxy_port}", settings, identity=handle.identity
            )
            try:
                await client.run(examples(4, sleep_s=1.0))
            except RolloutError as error:
                failure = error
            nursery.cancel_scope.cancel()
    assert "while the host still answers" in failure.message
    assert "reattached 0 time(s)" in failure.message
    assert_each_ran_once(hosts, 4)
    assert failure.reach is Reach.TAKEN
