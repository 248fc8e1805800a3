"""Peer 2: what a user might pick instead — a raw ASGI app on uvicorn with uvloop and httptools.

The batch runs as an asyncio task; the response starts at once and a one-space body piece is
streamed every heartbeat interval while the batch runs (uvicorn frames it chunked); a task
watching for ``http.disconnect`` cancels the batch when the caller leaves. Same routes,
workload, heartbeat interval and listen backlog as our host.

    python -m benchmarks.peers.asgi PORT [--heartbeat-s 1]
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

from benchmarks.workload import check, peer_arguments, think_asyncio

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
HEARTBEAT_S = 1.0
DEADLINE_S = 1800.0
HEADERS = [(b"content-type", b"application/json")]


async def run_batch(examples: list[dict[str, Any]], deadline_s: float) -> dict[str, Any]:
    try:
        results = await asyncio.wait_for(asyncio.gather(*map(think_asyncio, examples)), deadline_s)
    except TimeoutError:
        return {"error": {"code": "deadline_exceeded"}}
    return {"results": results, "job_id": "", "environment_path": "", "work_path": ""}


async def send_json(send: Send, status: int, document: Any) -> None:
    await send({"type": "http.response.start", "status": status, "headers": HEADERS})
    await send({"type": "http.response.body", "body": json.dumps(document).encode()})


async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if scope["method"] == "GET" and path.startswith("/health"):
        await send_json(send, 200, {"status": "ready"})
        return
    if scope["method"] != "POST" or not path.startswith("/rollouts/run"):
        await send_json(send, 404, {"error": {"code": "not_found"}})
        return
    body = bytearray()
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    try:
        request = json.loads(body)
        examples = request["examples"]
        for example in examples:
            check(example)
        deadline_s = min(request.get("deadline_s") or DEADLINE_S, DEADLINE_S)
    except (ValueError, KeyError, TypeError) as exc:
        await send_json(send, 400, {"error": {"code": "invalid_request", "message": str(exc)}})
        return
    batch = asyncio.create_task(run_batch(examples, deadline_s))

    async def watch_caller() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        batch.cancel()

    watcher = asyncio.create_task(watch_caller())
    try:
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        while not (await asyncio.wait([batch], timeout=HEARTBEAT_S))[0]:
            await send({"type": "http.response.body", "body": b" ", "more_body": True})
        document = await batch
        await send({"type": "http.response.body", "body": json.dumps(document).encode()})
    finally:
        watcher.cancel()
        batch.cancel()


def main() -> None:
    global HEARTBEAT_S
    args = peer_arguments(__doc__)
    HEARTBEAT_S = args.heartbeat_s
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=4096,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
