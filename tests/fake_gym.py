"""A Gym-compatible agent server and head server, on loopback, for the `agents` runner's tests.

Written with h11 directly (not with the project's HTTP layer, which they test). The agent
server's ``/run`` does what each example's ``_fake`` key asks: answer after ``delay_s``, answer
with ``status`` (``json_error`` makes the body a JSON string, as Gym's agents answer), ``hang``
until the caller leaves, ``drop`` the connection, or answer a Gym failure record
(``failure_class``) for the first ``fail_times`` requests of its ``key``, ``terminal`` or not.
Like Gym's servers, it watches for the caller leaving while it works and cancels the work when
it does. An episode request (``{episode_id, task}``, a taskset row) takes its ``_fake`` from
``task.task_input`` and is answered with an episode response.
"""

from __future__ import annotations

import json
from typing import Any

import h11
import trio
import yaml


async def read_request(stream: trio.abc.Stream) -> tuple[h11.Request, bytes]:
    parser = h11.Connection(h11.SERVER)
    head: h11.Request | None = None
    body = b""
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            return head, body
        else:
            raise EOFError(repr(event))


async def respond(stream: trio.abc.Stream, status: int, body: bytes) -> None:
    head = (
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    await stream.send_all(head + body)


class LoopbackServer:
    """A test server on a free loopback port, whose changes of state a test can wait for."""

    def __init__(self) -> None:
        self.port = 0
        self._changed = trio.Event()

    def _note(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Any) -> None:
        while not predicate(self):
            await self._changed.wait()

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.abc.Stream) -> None:
        raise NotImplementedError


class FakeAgentServer(LoopbackServer):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.requests: list[dict[str, Any]] = []
        self.running = 0
        self.peak = 0
        self.disconnects = 0
        self.failures_sent: dict[str, int] = {}

    async def handle(self, stream: trio.abc.Stream) -> None:
        try:
            head, body = await read_request(stream)
        except (EOFError, trio.BrokenResourceError):
            return
        if head.target != b"/run":
            await respond(stream, 404, b'{"detail": "Not Found"}')
            return
        example = json.loads(body)
        self.requests.append(example)
        self.running += 1
        self.peak = max(self.peak, self.running)
        self._note()
        answering = [False]  # once it answers, the caller closing is no departure
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    self._watch_for_departure, stream, nursery.cancel_scope, answering
                )
                await self._work(stream, example, answering)
                nursery.cancel_scope.cancel()
        finally:
            self.running -= 1
            self._note()

    async def _watch_for_departure(
        self, stream: trio.abc.Stream, scope: trio.CancelScope, answering: list[bool]
    ) -> None:
        try:
            while await stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        if not answering[0]:
            self.disconnects += 1  # the caller left: cancel the handler, as Gym's middleware does
            self._note()
            scope.cancel()

    async def _work(
        self, stream: trio.abc.Stream, example: dict[str, Any], answering: list[bool]
    ) -> None:
        episode = "episode_id" in example
        fake = (example["task"]["task_input"] if episode else example).get("_fake", {})
        if fake.get("hang"):
            await trio.sleep_forever()
        await trio.sleep(fake.get("delay_s", 0))
        answering[0] = True
        if fake.get("drop"):
            await stream.aclose()
            return
        if fake.get("cut"):  # the head and part of the body, then gone
            await stream.send_all(b"HTTP/1.1 200 X\r\ncontent-length: 100\r\n\r\n" + b"{" * 10)
            await stream.aclose()
            return
        if "status" in fake:
            body = b"agent exploded: " + b"x" * 2000
            if fake.get("json_error"):
                body = json.dumps('Hit an exception in SimpleAgent: it "broke"').encode()
            await respond(stream, fake["status"], body)
            return
        key = fake.get("key", "")
        if self.failures_sent.get(key, 0) < fake.get("fail_times", 0):
            self.failures_sent[key] = self.failures_sent.get(key, 0) + 1
            await respond(stream, 200, json.dumps(self._failure(example, fake)).encode())
            return
        answer = {
            "reward": 0.5,
            "agent": self.name,
            "response": {"output": []},
            "keys": sorted(example),
        }
        if episode:
            answer = {"episode_id": example["episode_id"], "task_id": "t", "result": answer}
        await respond(stream, 200, json.dumps(answer).encode())

    def _failure(self, example: dict[str, Any], fake: dict[str, Any]) -> dict[str, Any]:
        if "episode_id" in example:
            failure = {"failure_reason": "the fake failed it", "terminal": fake.get("terminal")}
            return {"episode_id": example["episode_id"], "task_id": "t", "failure": failure}
        return {
            "_ng_failure_class": fake["failure_class"],
            "_ng_failure_terminal": bool(fake.get("terminal")),
            "_ng_failure_message": "the fake failed it",
        }


class FakeHeadServer:
    """Serves ``GET /global_config_dict_yaml`` as Gym's head server does (JSON-wrapped YAML),
    and ``GET /health``: 200 when ``ready``, 503 while not, 404 (an older Gym) for ``None``."""

    def __init__(
        self,
        deployment: dict[str, Any],
        *,
        ready: bool | None = True,
        slow_after_reads: int | None = None,
    ) -> None:
        self.deployment = deployment
        self.ready = ready
        self.slow_after_reads = slow_after_reads
        """Reads of the config beyond this many take an hour (a deployment that stalls)."""
        self.reads = 0

    async def serve(
        self, *, port: int = 0, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.abc.Stream) -> None:
        head, _ = await read_request(stream)
        if head.target == b"/health":
            status = {True: 200, False: 503, None: 404}[self.ready]
            await respond(stream, status, b'{"status": "..."}')
            return
        assert head.target == b"/global_config_dict_yaml"
        self.reads += 1
        if self.slow_after_reads is not None and self.reads > self.slow_after_reads:
            await trio.sleep(3600)
        await respond(stream, 200, json.dumps(yaml.safe_dump(self.deployment)).encode())


def agent_instance(port: int) -> dict[str, Any]:
    return {"responses_api_agents": {"simple_agent": {"host": "127.0.0.1", "port": port}}}


def environment_instance(
    port: int, agent: str = "", *, implementation: str = "legacy_agent", **fields: Any
) -> dict[str, Any]:
    """An environment server in front of ``agent`` (its ``agent_server``) and of whatever
    ``fields`` reference."""
    server: dict[str, Any] = {"host": "127.0.0.1", "port": port, **fields}
    if agent:
        server["agent_server"] = {"type": "responses_api_agents", "name": agent}
    return {"environment_servers": {implementation: server}}
