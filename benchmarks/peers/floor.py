"""The stack's floor: how many short batches trio (and h11) can serve at all, layer by layer.

Not servers anyone should run — each does less than the contract asks, on purpose, so that the
host's requests per second can be read against what its own stack needs (BENCHMARKS.md):

- ``bare``: trio alone. The head is split by hand, the body read to its ``Content-Length``, and
  one canned chunked answer written; nothing is checked.
- ``h11``: trio and h11. h11 parses the request and frames a chunked answer; the body is parsed
  as JSON and the results document encoded; nothing is validated, nothing runs.
- ``tasks``: ``h11`` plus the shape of a rollout host: a nursery per connection holding a
  heartbeat task and a task per example (the benchmark workload, ``benchmarks.workload``).

    python -m benchmarks.peers.floor PORT --variant bare|h11|tasks [--heartbeat-s 1]
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

import h11
import trio

from benchmarks.workload import result

CANNED = b'{"results":[{"reward":1.0,"n":1}],"job_id":"","environment_path":"","work_path":""}'
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: close\r\n\r\n"
)
HEALTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def bare(stream: trio.SocketStream) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        piece = await stream.receive_some(65536)
        if not piece:
            return
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    if head.startswith(b"GET"):
        await stream.send_all(HEALTH)
        return
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += await stream.receive_some(65536)
    await stream.send_all(CHUNKED_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(CANNED), CANNED))


async def _read_request(conn: h11.Connection, stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """The method and body of the request (an empty method if the caller left first)."""
    method, body = b"", bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            method = event.method
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return method, bytes(body)
        else:
            return b"", b""


def _head(content_type: str, **extra: str) -> h11.Response:
    headers = [("content-type", content_type), ("connection", "close"), *extra.items()]
    return h11.Response(status_code=200, headers=headers)


async def with_h11(stream: trio.SocketStream, *, tasks: bool, heartbeat_s: float) -> None:
    conn = h11.Connection(h11.SERVER)
    method, body = await _read_request(conn, stream)
    if not method:
        return
    if method == b"GET":
        out = conn.send(_head("application/json", **{"content-length": "2"})) or b""
        await stream.send_all(out + (conn.send(h11.Data(data=b"{}")) or b""))
        return
    examples = json.loads(body)["examples"]
    await stream.send_all(
        conn.send(_head("application/json", **{"transfer-encoding": "chunked"})) or b""
    )
    if tasks:
        results: list[Any] = [None] * len(examples)
        async with trio.open_nursery() as nursery:

            async def heartbeat() -> None:
                while True:
                    await trio.sleep(heartbeat_s)
                    await stream.send_all(conn.send(h11.Data(data=b" ")) or b"")

            async def run(index: int, example: dict[str, Any]) -> None:
                await trio.sleep(example.get("think_s", 0))
                results[index] = result(example)

            nursery.start_soon(heartbeat)
            async with trio.open_nursery() as examples_nursery:
                for index, example in enumerate(examples):
                    examples_nursery.start_soon(run, index, example)
            nursery.cancel_scope.cancel()
    else:
        results = [result(example) for example in examples]
    document = json.dumps(
        {"results": results, "job_id": "", "environment_path": "", "work_path": ""}
    )
    out = conn.send(h11.Data(data=document.encode())) or b""
    await stream.send_all(out + (conn.send(h11.EndOfMessage()) or b""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("port", type=int)
    parser.add_argument("--variant", choices=["bare", "h11", "tasks"], required=True)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    args = parser.parse_args()
    if args.variant == "bare":
        handler: Any = bare
    else:
        handler = partial(with_h11, tasks=args.variant == "tasks", heartbeat_s=args.heartbeat_s)
    trio.run(partial(trio.serve_tcp, handler, args.port, host="127.0.0.1", backlog=4096))


if __name__ == "__main__":
    main()
