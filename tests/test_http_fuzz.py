"""Requests and answers mutated at random (seeded), against the host and between the two h11
builds (``h11`` and ``h11-mypyc``, the ``fast`` extra).

Random bytes (``test_garbage_storm_never_kills_the_server``) mostly stop at the request line;
these start from whole, valid messages and break them a little — a byte flipped, a span cut,
doubled or truncated, a CR, LF, NUL or colon dropped in — so the damage reaches the headers, the
framing and the body, where the parser has more to get wrong.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import trio

from tests.helpers import ScriptedRunner, read_reply, request_bytes, running_host, tcp_exchange
from trio_gym.http.h11_build import h11 as h11_in_use

HANG_GUARD_S = 60

BATCH = json.dumps({"examples": [{"result": 1}, {"result": 2}]}).encode()
CHUNKED_BATCH = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BATCH), BATCH)
REQUESTS = (
    request_bytes(BATCH, headers=[("Content-Type", "application/json")]),
    request_bytes(CHUNKED_BATCH, headers=[("Transfer-Encoding", "chunked")], content_length=False),
    request_bytes(method="GET", target="/health"),
    request_bytes(BATCH, headers=[("Accept", "application/x-ndjson")]),
    request_bytes(method="GET", target="/health", headers=[("Connection", "keep-alive")])
    + request_bytes(BATCH),
)
ANSWERS = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    b"1\r\n \r\n%s\r\n0\r\n\r\n" % CHUNKED_BATCH,
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nretry-after: 1\r\n\r\n{}",
    b"HTTP/1.0 200 OK\r\n\r\nclose-delimited body",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
)
# What an h11 event carries (the compiled build's events have no ``__dict__`` to list).
EVENT_FIELDS = (
    "method",
    "target",
    "http_version",
    "status_code",
    "reason",
    "data",
    "chunk_start",
    "chunk_end",
)
SPECIALS = (b"\r", b"\n", b"\r\n", b"\x00", b":", b" ", b"\t", b"0", b"-", b"\xff", b";")


def mutated(rng: random.Random, message: bytes) -> bytes:
    """``message`` with one to three random mutations."""
    data = bytearray(message)
    mutations: list[Callable[[bytearray], None]] = [
        lambda d: d.__setitem__(rng.randrange(len(d)), rng.randrange(256)),
        lambda d: d.__setitem__(slice(at := rng.randrange(len(d)), at), rng.choice(SPECIALS)),
        lambda d: d.__delitem__(slice(at := rng.randrange(len(d)), at + rng.randrange(1, 9))),
        lambda d: d.__setitem__(
            slice(at := rng.randrange(len(d)), at), d[at : at + rng.randrange(1, 33)]
        ),
        lambda d: d.__delitem__(slice(rng.randrange(1, len(d)), None)),
        lambda d: d.__setitem__(
            slice(at := rng.randrange(len(d)), at + 1), bytes([d[at]]).swapcase()
        ),
    ]
    for _ in range(rng.randrange(1, 4)):
        if len(data) > 1:
            rng.choice(mutations)(data)
    return bytes(data)


async def test_mutated_requests_never_kill_the_host_and_each_gets_http_or_a_close() -> None:
    """Every mutated request is answered with a well-formed response, or the connection closes
    — never a 500 (the host's own fault) and never a hang; afterwards the host still serves, and
    every example it started ended."""
    rng = random.Random(25)
    inputs = [mutated(rng, rng.choice(REQUESTS)) for _ in range(400)]
    statuses: list[int] = []
    runner = ScriptedRunner()

    async def send(data: bytes, slots: trio.CapacityLimiter) -> None:
        async with slots:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                try:
                    await stream.send_all(data)
                    await stream.send_eof()
                except trio.BrokenResourceError:
                    pass  # the host answered and closed before the rest arrived
                statuses.append((await read_reply(stream)).status)

    async with running_host(runner=runner) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                slots = trio.CapacityLimiter(32)
                for data in inputs:
                    nursery.start_soon(send, data, slots)
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
        batch = await tcp_exchange(port, REQUESTS[0])
        stats = host.services.stats
    assert health.status == 200 and batch.status == 200 and len(batch.json()["results"]) == 2
    assert len(statuses) == len(inputs)
    assert 500 not in statuses and set(statuses) <= {
        0,
        200,
        400,
        404,
        405,
        411,
        413,
        415,
        422,
        431,
        501,
        505,
    }
    assert {200, 400} <= set(statuses)  # the mutations both miss and hit
    assert stats.examples_running == 0 and stats.examples_failed == 0


def _build(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.skip(f"{name} is not installed (pip install -e '.[fast]' adds h11-mypyc)")


def _events(h11: ModuleType, role: str, data: bytes, cuts: list[int]) -> list[Any]:
    """What a ``role`` connection of ``h11`` makes of ``data`` arriving in pieces at ``cuts``:
    each event's type and fields, then how it stopped (a protocol error with its status hint,
    or the connection's states)."""
    conn = h11.Connection(getattr(h11, role), max_incomplete_event_size=4096)
    if role == "CLIENT":
        conn.send(h11.Request(method="POST", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
    seen: list[Any] = []
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    try:
        for piece in [*pieces, b""]:
            conn.receive_data(piece)
            while (event := conn.next_event()) is not h11.NEED_DATA:
                if event is h11.PAUSED:  # a second message behind the first: stop there
                    return [*seen, "paused"]
                fields = {
                    name: getattr(event, name) for name in EVENT_FIELDS if hasattr(event, name)
                }
                headers = [tuple(map(bytes, h)) for h in getattr(event, "headers", [])]
                seen.append((type(event).__name__, fields, headers))
                if type(event).__name__ == "ConnectionClosed":
                    return [*seen, "closed"]
    except h11.RemoteProtocolError as exc:
        return [*seen, ("error", exc.error_status_hint)]
    return [*seen, (conn.our_state.__name__, conn.their_state.__name__)]


def test_h11_mypyc_makes_of_every_mutated_message_what_h11_makes() -> None:
    """The accelerator is adopted only if it parses exactly as h11 does: the same events with
    the same fields, the same errors with the same status, for 6,000 mutated requests and
    answers, each fed to both in the same random pieces."""
    pure, compiled = _build("h11"), _build("h11_mypyc")
    rng = random.Random(2511)
    compared = 0
    for role, messages in (("SERVER", REQUESTS), ("CLIENT", ANSWERS)):
        for _ in range(3000):
            data = mutated(rng, rng.choice(messages))
            cuts = sorted(
                rng.sample(range(1, len(data)), min(max(len(data) - 1, 0), rng.randrange(4)))
            )
            expected = _events(pure, role, data, cuts)
            assert _events(compiled, role, data, cuts) == expected, (role, data, cuts)
            compared += 1
    assert compared == 6000


def test_the_build_in_use_is_the_one_installed() -> None:
    """With h11-mypyc installed the host speaks it; without, h11 (the ``fast`` extra is
    optional, never required)."""
    try:
        importlib.import_module("h11_mypyc")
    except ImportError:
        assert h11_in_use.__name__ == "h11"
    else:
        assert h11_in_use.__name__ == "h11_mypyc"
