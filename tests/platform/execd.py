#!/usr/bin/python3
"""A stand-in for OpenSandbox's execd (a Go program that cannot be built here): it answers the
SDK's readiness ``GET /ping`` and nothing else. Under host networking every sandbox's copy
competes for execd's fixed port, so it keeps trying to bind: whoever holds the port answers for
all, and another takes over when that sandbox ends. Not on the path between the server's proxy
and a sandbox's port (NOTES.md, "Real sandbox platforms")."""

import http.server
import time

PORT = 44772


class Ping(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = 200 if self.path.split("?")[0] == "/ping" else 404
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


while True:
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", PORT), Ping)
    except OSError:
        time.sleep(0.5)
        continue
    server.serve_forever()
