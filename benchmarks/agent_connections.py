"""Does keep-alive toward agent servers pay? A connection per request against one reused.

The `agents` runner opens a connection per example (closing it is how a Gym server learns the
example was cancelled). This measures what that costs on loopback, against the same requests
sent over one kept-alive connection, with the same server, in the same run:

    python benchmarks/agent_connections.py [requests]

It reports the per-request time of each and the difference; the NOTES compare that difference
with how long an agent's /run takes.
"""

from __future__ import annotations

import sys
import time

import h11
import trio

from trio_gym.http import Endpoint, HttpLimits, exchange

ANSWER = b'{"reward": 1.0, "response": {"output": []}}'


async def serve_keep_alive(stream: trio.SocketStream) -> None:
    """Answers POST /run at once, for as many requests as the connection carries."""
    conn = h11.Connection(h11.SERVER)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            conn.receive_data(data)
            if not data and conn.their_state is h11.IDLE:
                return
            continue
        if isinstance(event, h11.EndOfMessage):
            headers = [("content-type", "application/json"), ("content-length", str(len(ANSWER)))]
            out = conn.send(h11.Response(status_code=200, headers=headers))
            out += conn.send(h11.Data(data=ANSWER)) + conn.send(h11.EndOfMessage())
            await stream.send_all(out)
            if conn.our_state is h11.MUST_CLOSE:
                await stream.aclose()
                return
            conn.start_next_cycle()
        elif isinstance(event, h11.ConnectionClosed):
            return


async def per_request(endpoint: Endpoint, body: bytes, count: int) -> float:
    limits = HttpLimits()
    started = time.perf_counter()  # clock-ok: a benchmark measures wall time
    for _ in range(count):
        response = await exchange(
            endpoint,
            "POST",
            "/run",
            body,
            limits=limits,
            max_response_bytes=1 << 20,
            idle_timeout_s=10,
        )
        assert response.status == 200
    return (time.perf_counter() - started) / count  # clock-ok


async def kept_alive(endpoint: Endpoint, body: bytes, count: int) -> float:
    stream = await trio.open_tcp_stream(endpoint.host, endpoint.port)
    conn = h11.Connection(h11.CLIENT)
    started = time.perf_counter()  # clock-ok
    async with stream:
        for _ in range(count):
            request = h11.Request(
                method="POST",
                target="/run",
                headers=[("host", endpoint.authority), ("content-length", str(len(body)))],
            )
            await stream.send_all(
                conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            )
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.EndOfMessage):
                    break
            conn.start_next_cycle()
    return (time.perf_counter() - started) / count  # clock-ok


async def main(count: int) -> None:
    body = b'{"agent_ref": {"name": "a"}, "responses_create_params": {"input": "hi"}}'
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, serve_keep_alive, 0)
        endpoint = Endpoint("127.0.0.1", listeners[0].socket.getsockname()[1], "")
        await per_request(endpoint, body, 100)  # warm up
        fresh = await per_request(endpoint, body, count)
        reused = await kept_alive(endpoint, body, count)
        nursery.cancel_scope.cancel()
    print(f"requests: {count} sequential, loopback")
    print(f"connection per request: {fresh * 1e6:8.1f} us per request")
    print(f"one kept-alive connection: {reused * 1e6:8.1f} us per request")
    print(f"difference: {(fresh - reused) * 1e6:.1f} us per request ({fresh / reused:.2f}x)")
    print(f"share of a 100 ms agent /run: {(fresh - reused) / 0.1:.4%}")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
