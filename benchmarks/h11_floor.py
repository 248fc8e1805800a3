"""How many request/answer cycles h11 alone can do on one core: the floor under short batches.

The short-batch target asks for uvicorn's requests per second (httptools and uvloop are C). This
measures only the HTTP work trio_gym's host cannot avoid with h11 as its HTTP core — parse one
POST head and body, write a chunked 200 head, one data chunk and the end — with no sockets, no
trio and no JSON, and prints the cycles per second beside the figure to compare with:

    python benchmarks/h11_floor.py [cycles]
"""

from __future__ import annotations

import sys
import time

import h11

BODY = b'{"examples": [{"n": 1, "think_s": 0}]}'
REQUEST = (
    b"POST /rollouts/run HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
DOCUMENT = b'{"results":[{"reward":1.0,"n":1}],"job_id":"","environment_path":"","work_path":""}'


def cycle() -> int:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(REQUEST)
    while not isinstance(conn.next_event(), h11.EndOfMessage):
        pass
    head = h11.Response(
        status_code=200,
        headers=[
            ("content-type", "application/json"),
            ("transfer-encoding", "chunked"),
            ("connection", "close"),
        ],
    )
    out = conn.send(head) or b""
    out += conn.send(h11.Data(data=DOCUMENT)) or b""
    out += conn.send(h11.EndOfMessage()) or b""
    return len(out)


def main() -> None:
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    cycle()
    started = time.perf_counter()
    for _ in range(cycles):
        cycle()
    elapsed = time.perf_counter() - started
    print(f"h11 alone: {cycles / elapsed:,.0f} request/answer cycles per second on one core")
    print(f"({1e6 * elapsed / cycles:.0f} µs each; uvicorn's whole request at 5,516/s: 181 µs)")


if __name__ == "__main__":
    main()
