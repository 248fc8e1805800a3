"""The load generator: one process, many raw connections, times taken from the kernel.

Run by ``benchmarks/run.py`` as a subprocess (several at once for large counts); it prints one
JSON line per event the orchestrator waits for (``{"held": n}`` once every connection has its
status line) and a final JSON line with the figures. Heartbeat times are the kernel's receive
timestamps (``SO_TIMESTAMPNS``), so a busy generator does not make a server look late.

    python -m benchmarks.load hold PORT COUNT THINK_S [--heartbeat-s 1]
    python -m benchmarks.load probe PORT COUNT            # sequential time to first byte
    python -m benchmarks.load stop PORT COUNT reset|close|deadline
    python -m benchmarks.load large PORT EXAMPLES BLOB_BYTES
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time
from typing import Any

import h11
import trio

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
HEARTBEAT_CHUNK = b"1\r\n \r\n"
CONNECTS_AT_ONCE = 256  # keeps a SYN burst inside the listen backlog of every server alike


def request(examples: list[dict[str, Any]], deadline_s: float | None = None) -> bytes:
    body = json.dumps({"examples": examples, **({"deadline_s": deadline_s} if deadline_s else {})})
    return (
        b"POST /rollouts/run HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body.encode())
    )


def parse(raw: bytes) -> tuple[int, bytes]:
    """The status and body of a whole response, checked by h11 (framing included)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(
        h11.Request(method="POST", target="/", headers=[("host", "b"), ("content-length", "0")])
    )
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    conn.receive_data(b"")
    status, body = 0, bytearray()
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, bytes(body)
        elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
            raise ValueError("the response ended before its framing said it was complete")


def kernel_time(ancillary: list[tuple[int, int, bytes]]) -> float:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            seconds, nanoseconds = struct.unpack("qq", data[:16])
            return seconds + nanoseconds / 1e9
    return time.time()


async def connect(port: int) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await sock.connect(("127.0.0.1", port))
    return sock


class Held:
    """One held connection: its bytes and the kernel time of each piece received."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.times: list[float] = []
        self.pieces: list[bytes] = []
        self.error = ""


async def hold_one(
    port: int, n: int, think_s: float, gate: trio.CapacityLimiter, headed: trio.Event, out: Held
) -> None:
    try:
        async with gate:
            sock = await connect(port)
        with sock:
            await sock.send(request([{"n": n, "think_s": think_s}]))
            while True:
                data, ancillary, _, _ = await sock.recvmsg(65536, 256)
                if not data:
                    break
                out.times.append(kernel_time(ancillary))
                out.pieces.append(data)
                out.raw += data
                headed.set()
    except OSError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        headed.set()


def heartbeat_lateness(held: Held, interval: float) -> list[tuple[float, float]]:
    """(arrival, seconds late) of each heartbeat: late past the interval since the previous
    piece."""
    late = []
    for previous, now, piece in zip(held.times, held.times[1:], held.pieces[1:], strict=False):
        if piece == HEARTBEAT_CHUNK:
            late.append((now, max(0.0, now - previous - interval)))
    return late


def correct(held: Held, n: int) -> bool:
    try:
        status, body = parse(bytes(held.raw))
        results = json.loads(body)["results"]
    except (ValueError, KeyError, TypeError, h11.ProtocolError):
        return False
    return status == 200 and len(results) == 1 and results[0].get("n") == n


async def hold(
    port: int, count: int, think_s: float, interval: float, first_n: int
) -> dict[str, Any]:
    gate = trio.CapacityLimiter(CONNECTS_AT_ONCE)
    helds = [Held() for _ in range(count)]
    events = [trio.Event() for _ in range(count)]
    async with trio.open_nursery() as nursery:
        for i, held in enumerate(helds):
            nursery.start_soon(hold_one, port, first_n + i, think_s, gate, events[i], held)

        async def announce() -> None:
            for event in events:
                await event.wait()
            print(json.dumps({"held": sum(1 for h in helds if h.times)}), flush=True)

        nursery.start_soon(announce)
    late = [x for held in helds for x in heartbeat_lateness(held, interval)]
    return {
        "count": count,
        "correct": sum(correct(held, first_n + i) for i, held in enumerate(helds)),
        "errors": sorted({held.error for held in helds if held.error})[:5],
        "lateness": late,
    }


async def probe(port: int, count: int) -> dict[str, Any]:
    """Sequential one-example batches that finish at once: time from send to status line."""
    ttfb = []
    for n in range(count):
        sock = await connect(port)
        with sock:
            sent = trio.current_time()
            await sock.send(request([{"n": n, "think_s": 0}]))
            raw = bytearray(await sock.recv(65536))
            ttfb.append(trio.current_time() - sent)
            while data := await sock.recv(65536):
                raw += data
        if not raw.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"probe {n}: {bytes(raw[:200])!r}")
    return {"ttfb": ttfb}


async def stop(port: int, count: int, how: str) -> dict[str, Any]:
    """Start a long example, then leave (reset or close) or let its deadline pass; report when
    each left (CLOCK_MONOTONIC) so the orchestrator can match the host's cancel records."""
    left: dict[str, float] = {}
    for n in range(count):
        tag = f"{how}-{n}"
        sock = await connect(port)
        deadline_s = 0.5 if how == "deadline" else None
        sent = time.monotonic()
        await sock.send(request([{"n": n, "think_s": 30, "tag": tag}], deadline_s))
        await sock.recv(65536)  # the status line: the example is running
        if how == "deadline":
            left[tag] = sent + 0.5
            while await sock.recv(65536):
                pass
        else:
            await trio.sleep(0.3)
            if how == "reset":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            left[tag] = time.monotonic()
        sock.close()
        await trio.sleep(2.5)  # time for a slow server to notice before the next one
    return {"left": left}


async def large(port: int, examples: int, blob_bytes: int) -> dict[str, Any]:
    sock = await connect(port)
    raw = bytearray()
    with sock:
        started = trio.current_time()
        await sock.send(
            request([{"n": n, "think_s": 0, "blob_bytes": blob_bytes} for n in range(examples)])
        )
        while data := await sock.recv(1 << 20):
            raw += data
        elapsed = trio.current_time() - started
    status, body = parse(bytes(raw))
    results = json.loads(body)["results"]
    ok = (
        status == 200
        and len(results) == examples
        and all(len(r["blob"]) == blob_bytes for r in results)
    )
    return {"document_bytes": len(body), "seconds": elapsed, "correct": ok}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=["hold", "probe", "stop", "large"])
    parser.add_argument("port", type=int)
    parser.add_argument("args", nargs="*")
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--first-n", type=int, default=0)
    ns = parser.parse_args()
    if ns.workload == "hold":
        figures = trio.run(
            hold, ns.port, int(ns.args[0]), float(ns.args[1]), ns.heartbeat_s, ns.first_n
        )
    elif ns.workload == "probe":
        figures = trio.run(probe, ns.port, int(ns.args[0]))
    elif ns.workload == "stop":
        figures = trio.run(stop, ns.port, int(ns.args[0]), ns.args[1])
    else:
        figures = trio.run(large, ns.port, int(ns.args[0]), int(ns.args[1]))
    print(json.dumps({"figures": figures}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
