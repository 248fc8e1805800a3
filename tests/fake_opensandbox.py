"""A fake of the OpenSandbox server's REST API whose sandboxes are local processes.

No Docker daemon is reachable on these machines, so a real OpenSandbox cannot run here; this
serves the part of its lifecycle API the SDK's create/endpoint/renew/kill/list calls use, with
the SDK's own JSON shapes, so the provider is tested through the real SDK. A sandbox is its
entrypoint run as a process in a session of its own, with the requested environment, its
``NMP_RUNTIME_HTTP_PORT`` published on a free local port (as ``docker -P`` would); it ends when
killed, when its TTL passes, or when the fake stops.

    python -m tests.fake_opensandbox --port-file FILE --api-key KEY

Test hooks (not OpenSandbox's): ``POST /_fake/lose-next-create`` makes the next create start its
sandbox and then drop the connection unanswered; ``GET /_fake/sandboxes`` lists every sandbox
ever created with its request, state and renewals.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

API = "/v1"
INTERNAL_PORTS = (44772, 18080)  # execd and egress: the SDK asks for them on every create


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def iso(moment: datetime.datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Sandbox:
    def __init__(self, request: dict[str, Any]) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.request = request
        self.created = now()
        timeout = request.get("timeout")
        self.expires = (
            None if timeout is None else self.created + datetime.timedelta(seconds=timeout)
        )
        self.renewals = 0
        self.state, self.reason = "Running", ""
        self.port = free_port()
        environment = {**os.environ, **request.get("env", {})}
        environment["NMP_RUNTIME_HTTP_PORT"] = str(self.port)  # published, as docker -P would
        environment["NMP_RUNTIME_HTTP_HOST"] = "127.0.0.1"
        self.process = subprocess.Popen(
            request["entrypoint"],
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def refresh(self) -> None:
        if self.state == "Running" and self.process.poll() is not None:
            self.state, self.reason = "Failed", f"exited with status {self.process.returncode}"
        if self.state == "Running" and self.expires is not None and now() > self.expires:
            self.stop("expired")

    def stop(self, reason: str) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.state in ("Running", "Pending"):
            self.state, self.reason = "Terminated", reason

    def info(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "id": self.id,
            "status": {"state": self.state, "reason": self.reason or None},
            "entrypoint": self.request["entrypoint"],
            "createdAt": iso(self.created),
            "metadata": self.request.get("metadata", {}),
            "image": self.request.get("image"),
        }
        if self.expires is not None:
            document["expiresAt"] = iso(self.expires)
        document["status"] = {k: v for k, v in document["status"].items() if v is not None}
        return document


class Fake:
    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        self.sandboxes: dict[str, Sandbox] = {}
        self.lock = threading.Lock()
        self.lose_next_create = False

    def reap(self, stop: threading.Event) -> None:
        while not stop.wait(0.1):
            with self.lock:
                for sandbox in self.sandboxes.values():
                    sandbox.refresh()


def handler_for(fake: Fake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def answer(self, status: int, document: Any = None) -> None:
            body = b"" if document is None else json.dumps(document).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def body(self) -> dict[str, Any]:
            length = int(self.headers.get("content-length") or 0)
            data: dict[str, Any] = json.loads(self.rfile.read(length) or b"{}")
            return data

        def route(self, method: str) -> None:
            parts = urllib.parse.urlsplit(self.path)
            path, query = parts.path, urllib.parse.parse_qs(parts.query)
            if path.startswith("/_fake/"):
                self.fake_hook(method, path)
                return
            if self.headers.get("OPEN-SANDBOX-API-KEY") != fake.api_key:
                self.answer(401, {"code": "UNAUTHORIZED", "message": "bad or missing API key"})
                return
            segments = path.removeprefix(API).strip("/").split("/")
            with fake.lock:
                if method == "POST" and segments == ["sandboxes"]:
                    self.create()
                elif method == "GET" and segments == ["sandboxes"]:
                    self.list(query)
                elif segments[0] == "sandboxes" and segments[1:2] and segments[1] in fake.sandboxes:
                    self.one(method, fake.sandboxes[segments[1]], segments[2:])
                else:
                    self.answer(404, {"code": "NOT_FOUND", "message": f"{method} {path}"})

        def create(self) -> None:
            sandbox = Sandbox(self.body())
            fake.sandboxes[sandbox.id] = sandbox
            if fake.lose_next_create:
                fake.lose_next_create = False
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)  # created, and the answer lost
                return
            self.answer(202, sandbox.info())

        def list(self, query: dict[str, list[str]]) -> None:
            wanted = dict(
                urllib.parse.parse_qsl(urllib.parse.unquote(query.get("metadata", [""])[0]))
            )
            items = [
                sandbox.info()
                for sandbox in fake.sandboxes.values()
                if wanted.items() <= sandbox.request.get("metadata", {}).items()
            ]
            pages = {"page": 1, "pageSize": len(items), "totalItems": len(items), "totalPages": 1}
            self.answer(200, {"items": items, "pagination": {**pages, "hasNextPage": False}})

        def one(self, method: str, sandbox: Sandbox, rest: list[str]) -> None:
            sandbox.refresh()
            if method == "GET" and not rest:
                self.answer(200, sandbox.info())
            elif method == "DELETE" and not rest:
                sandbox.stop("killed")
                self.answer(204)
            elif method == "GET" and rest[:1] == ["endpoints"] and len(rest) == 2:
                port = int(rest[1])
                if port in INTERNAL_PORTS:
                    self.answer(200, {"endpoint": "127.0.0.1:9"})
                else:
                    headers = {"X-Fake-Sandbox": sandbox.id}
                    self.answer(200, {"endpoint": f"127.0.0.1:{sandbox.port}", "headers": headers})
            elif method == "POST" and rest == ["renew-expiration"]:
                expires = datetime.datetime.fromisoformat(self.body()["expiresAt"])
                sandbox.expires, sandbox.renewals = expires, sandbox.renewals + 1
                self.answer(200, {"expiresAt": iso(expires)})
            else:
                self.answer(404, {"code": "NOT_FOUND", "message": f"{method} {rest}"})

        def fake_hook(self, method: str, path: str) -> None:
            with fake.lock:
                if method == "POST" and path == "/_fake/lose-next-create":
                    fake.lose_next_create = True
                    self.answer(204)
                elif method == "GET" and path == "/_fake/sandboxes":
                    for sandbox in fake.sandboxes.values():
                        sandbox.refresh()
                    self.answer(
                        200,
                        [
                            {**s.info(), "request": s.request, "renewals": s.renewals}
                            for s in fake.sandboxes.values()
                        ],
                    )
                else:
                    self.answer(404)

        def do_GET(self) -> None:
            self.route("GET")

        def do_POST(self) -> None:
            self.route("POST")

        def do_DELETE(self) -> None:
            self.route("DELETE")

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--api-key", required=True)
    args = parser.parse_args()
    fake = Fake(args.api_key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(fake))
    stop = threading.Event()
    reaper = threading.Thread(target=fake.reap, args=(stop,), daemon=True)
    reaper.start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    temporary = args.port_file.with_suffix(".tmp")
    temporary.write_text(str(server.server_address[1]))
    temporary.rename(args.port_file)
    try:
        server.serve_forever()
    finally:
        stop.set()
        with fake.lock:
            for sandbox in fake.sandboxes.values():
                sandbox.stop("the server stopped")


if __name__ == "__main__":
    main()
