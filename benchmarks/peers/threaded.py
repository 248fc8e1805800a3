"""Peer 1: the design trio_gym replaces — the standard library's ``ThreadingHTTPServer``.

One thread per connection; every batch runs on one shared asyncio loop in a background thread;
the handler thread waits on the batch's future and writes a one-space chunk every heartbeat
interval; a failed write cancels the batch. HTTP/1.1 chunked (the framing after seed 000),
connection reuse declined, HTTP/1.0 callers buffered behind Content-Length. Same routes, same
workload, same heartbeat interval and listen backlog as our host: a yardstick, not a strawman.

    python -m benchmarks.peers.threaded PORT [--heartbeat-s 1]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from benchmarks.workload import check, peer_arguments, think_asyncio

LOOP = asyncio.new_event_loop()
HEARTBEAT_S = 1.0
DEADLINE_S = 1800.0


async def run_batch(examples: list[dict[str, Any]], deadline_s: float) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*map(think_asyncio, examples)), deadline_s)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/health"):
            self._send_json(200, {"status": "ready"})
        else:
            self._send_json(404, {"error": {"code": "not_found"}})

    def do_POST(self) -> None:
        self.close_connection = True
        if not self.path.startswith("/rollouts/run"):
            self._send_json(404, {"error": {"code": "not_found"}})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            examples = body["examples"]
            for example in examples:
                check(example)
            deadline_s = min(body.get("deadline_s") or DEADLINE_S, DEADLINE_S)
        except (ValueError, KeyError, TypeError) as exc:
            self._send_json(400, {"error": {"code": "invalid_request", "message": str(exc)}})
            return
        future = asyncio.run_coroutine_threadsafe(run_batch(examples, deadline_s), LOOP)
        chunked = self.request_version == "HTTP/1.1"
        if chunked:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.flush()
        while not concurrent.futures.wait([future], timeout=HEARTBEAT_S).done:
            if chunked:
                try:
                    self.wfile.write(b"1\r\n \r\n")
                    self.wfile.flush()
                except OSError:
                    future.cancel()
                    return
        document: dict[str, Any]
        try:
            document = {"results": future.result()}
        except TimeoutError:
            document = {"error": {"code": "deadline_exceeded"}}
        except Exception as exc:
            document = {"error": {"code": "internal", "message": repr(exc)}}
        document.update(job_id="", environment_path="", work_path="")
        data = json.dumps(document).encode()
        if chunked:
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        else:
            self._send(200, data)

    def _send_json(self, status: int, document: Any) -> None:
        self._send(status, json.dumps(document).encode())

    def _send(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # the same backlog as trio's listeners get here (somaxconn)


def main() -> None:
    global HEARTBEAT_S
    args = peer_arguments(__doc__)
    HEARTBEAT_S = args.heartbeat_s
    threading.Thread(target=LOOP.run_forever, daemon=True).start()
    Server(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
