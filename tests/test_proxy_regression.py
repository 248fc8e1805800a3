"""The seed's regression: the whole document must arrive through a proxy that ends a response
when its framing says it is complete, without waiting for the connection to close."""

from __future__ import annotations

import functools
import http.client
import json
from typing import Any

import pytest
import trio

from tests.framing_proxy import FramingProxy
from tests.helpers import CountingRunner, running_host

HANG_GUARD_S = 30


def post_through(port: int, body: dict[str, Any], *, http10: bool = False) -> tuple[int, bytes]:
    """What a trainer does: http.client, read the response to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_GUARD_S)
    if http10:
        conn._http_vsn, conn._http_vsn_str = 10, "HTTP/1.0"  # type: ignore[attr-defined]
    try:
        conn.request("POST", "/rollouts/run", body=json.dumps(body).encode())
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def options_through(port: int) -> tuple[int, bytes, str | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_GUARD_S)
    conn._http_vsn, conn._http_vsn_str = 10, "HTTP/1.0"  # type: ignore[attr-defined]
    try:
        conn.request("OPTIONS", "/health")
        response = conn.getresponse()
        return response.status, response.read(), response.getheader("content-length")
    finally:
        conn.close()


@pytest.mark.parametrize("http10", [False, True], ids=["http11", "http10"])
async def test_a_long_batch_arrives_whole_through_the_framing_proxy(http10: bool) -> None:
    runner = CountingRunner()
    batch = {"examples": [{"seed": i, "meetings": 4, "think_s": 0.1} for i in range(5)]}
    async with running_host(runner=runner, heartbeat_interval_s=0.05) as (host, port):
        proxy = FramingProxy(port)
        async with trio.open_nursery() as nursery:
            proxy_port = await nursery.start(proxy.serve)
            post = functools.partial(post_through, proxy_port, batch, http10=http10)
            status, body = await trio.to_thread.run_sync(post)
            nursery.cancel_scope.cancel()
    assert status == 200
    document = json.loads(body)  # the seed failed here: "Expecting value"
    assert [result["seed"] for result in document["results"]] == [0, 1, 2, 3, 4]
    assert proxy.framings == ["content-length" if http10 else "chunked"]
    if not http10:
        assert body.startswith(b" ")  # heartbeats went through the proxy before the document


async def test_an_empty_response_through_the_framing_proxy_is_framed() -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        proxy = FramingProxy(port)
        async with trio.open_nursery() as nursery:
            proxy_port = await nursery.start(proxy.serve)
            status, body, length = await trio.to_thread.run_sync(options_through, proxy_port)
            nursery.cancel_scope.cancel()
    assert (status, body, length) == (200, b"", "0")
    assert proxy.framings == ["content-length"]


async def _seed_bug_host(stream: trio.SocketStream) -> None:
    """The host before the fix: heartbeats in a body framed by nothing but the close."""
    await stream.receive_some(65536)
    await stream.send_all(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n")
    await stream.send_all(b" ")
    await trio.sleep(0.2)
    await stream.send_all(b'{"results": [1]}')


async def test_the_proxy_reproduces_the_seed_bug_against_an_unframed_host() -> None:
    """Proof that the proxy can fail the tests above: against the old framing it truncates."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, _seed_bug_host, 0)
        upstream_port = listeners[0].socket.getsockname()[1]
        proxy = FramingProxy(upstream_port)
        proxy_port = await nursery.start(proxy.serve)
        status, body = await trio.to_thread.run_sync(post_through, proxy_port, {"examples": []})
        nursery.cancel_scope.cancel()
    assert status == 200 and body == b" "
    with pytest.raises(json.JSONDecodeError, match="Expecting value"):
        json.loads(body)
    assert proxy.framings == ["close-delimited"]
