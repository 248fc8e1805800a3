"""How many request/answer cycles h11 alone can do on one core: the floor under short batches.

The short-batch target asks for uvicorn's requests per second (httptools and uvloop are C). This
measures only the HTTP work trio_gym's host cannot avoid with h11 as its HTTP core — parse one
POST head and body, write a chunked 200 head, one data chunk and the end — with no sockets, no
trio and no JSON. When ``h11-mypyc`` (h11 compiled with mypyc, the same API) is installed, it is
measured in the same run, interleaved, and the ratio printed:

    python benchmarks/h11_floor.py [cycles]
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import sys
import time
from types import ModuleType

BODY = b'{"examples": [{"n": 1, "think_s": 0}]}'
REQUEST = (
    b"POST /rollouts/run HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
DOCUMENT = b'{"results":[{"reward":1.0,"n":1}],"job_id":"","environment_path":"","work_path":""}'


def cycle(h11: ModuleType) -> int:
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


def cycles_per_s(h11: ModuleType, cycles: int) -> float:
    started = time.perf_counter()
    for _ in range(cycles):
        cycle(h11)
    return cycles / (time.perf_counter() - started)


def main() -> None:
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    builds = {"h11": importlib.import_module("h11")}
    with contextlib.suppress(ImportError):
        builds["h11-mypyc"] = importlib.import_module("h11_mypyc")
    rates: dict[str, list[float]] = {name: [] for name in builds}
    for h11 in builds.values():
        cycle(h11)
    for _ in range(5):  # interleaved, so a noisy neighbour slows both alike
        for name, h11 in builds.items():
            rates[name].append(cycles_per_s(h11, cycles))
    for name, runs in rates.items():
        rate = statistics.median(runs)
        print(
            f"{name} alone: {rate:,.0f} request/answer cycles per second on one core "
            f"({1e6 / rate:.0f} µs each; median of 5)"
        )
    if "h11-mypyc" in rates:
        ratio = statistics.median(rates["h11-mypyc"]) / statistics.median(rates["h11"])
        print(f"h11-mypyc / h11: {ratio:.2f} times")
    print("(uvicorn's whole request at 5,516/s: 181 µs)")


if __name__ == "__main__":
    main()
