"""A cheap OpenAI-compatible model for ``benchmarks/gym_peer.py``: raw asyncio, one process.

    python benchmarks/gym_stub_model.py PORT_FILE     # listens on a free loopback port

Gym's ``openai_model`` server calls ``POST /v1/responses``; this answers it the way the weather
verifier rewards 1: a ``get_weather`` call first, then, once the tool's output is in the input, a
plain message. A row asks the model to "think" by saying ``[think S]`` in its user message: the
answer then comes ``S`` seconds later (both calls of the row), unless the caller hangs up first.
Like a vLLM policy in training, the item it generates carries ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs`` (what Gym's token-ID capture records), a
continuation's prompt extending its parent's prompt and generation.

Every model call is recorded with ``time.monotonic()`` (CLOCK_MONOTONIC, the same clock in every
process of the machine): ``[row, call, started, ended, outcome]`` with outcome ``answered`` or
``cut`` (the caller's connection ended while the call was open). The row number comes from
``[row N]`` in the user message. Control, for the benchmark (plain GETs):

- ``GET /stats``: ``{"open": calls open now, "answered": n, "cut": n}``;
- ``GET /calls``: every call recorded since the last ``GET /reset`` (open ones with ``ended``
  null), as JSON;
- ``GET /reset``: forget the recorded calls (the open ones stay counted as open).

HTTP/1.1 with keep-alive (Gym's aiohttp client reuses connections), bodies by Content-Length;
nothing else is needed by the one client it has.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROW = re.compile(r"\[row (\d+)\]")
THINK = re.compile(r"\[think ([0-9.]+)\]")
_ids = itertools.count()


class Calls:
    def __init__(self) -> None:
        self.records: list[list[Any]] = []
        self.open = 0
        self.answered = 0
        self.cut = 0

    def start(self, row: int, call: int) -> list[Any]:
        record = [row, call, time.monotonic(), None, None]
        self.records.append(record)
        self.open += 1
        return record

    def end(self, record: list[Any], outcome: str) -> None:
        if record[4] is not None:
            return
        record[3], record[4] = time.monotonic(), outcome
        self.open -= 1
        if outcome == "answered":
            self.answered += 1
        else:
            self.cut += 1


CALLS = Calls()


def _response(output: list[dict[str, Any]]) -> bytes:
    return json.dumps(
        {
            "id": f"resp-{next(_ids)}",
            "created_at": 1.0,
            "model": "stub",
            "object": "response",
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "output": output,
        }
    ).encode()


def _item_tokens(item: dict[str, Any]) -> list[int]:
    """The ids one item stands for, the same for an item generated and for it echoed back."""
    kind = item.get("type") or "message"
    if kind == "function_call":
        text = f"call {item.get('name')} {item.get('arguments')}"
    elif kind == "function_call_output":
        text = f"output {item.get('output')}"
    else:
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        text = f"{item.get('role', 'assistant')} {content}"
    return [3 + byte % 250 for byte in text.encode()[:24]]


def _with_tokens(item: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    items = request.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    prompt = [t for i in items or [] if isinstance(i, dict) for t in _item_tokens(i)]
    generated = _item_tokens(item)
    return {
        **item,
        "prompt_token_ids": prompt,
        "generation_token_ids": generated,
        "generation_log_probs": [-0.5] * len(generated),
    }


def _message(request: dict[str, Any]) -> bytes:
    item = {
        "id": f"msg-{next(_ids)}",
        "content": [{"annotations": [], "text": "Sunny.", "type": "output_text"}],
        "role": "assistant",
        "status": "completed",
        "type": "message",
    }
    return _response([_with_tokens(item, request)])


def _weather_call(request: dict[str, Any]) -> bytes:
    item = {
        "id": f"fc-{next(_ids)}",
        "call_id": f"call-{next(_ids)}",
        "name": "get_weather",
        "arguments": '{"city": "San Francisco"}',
        "type": "function_call",
        "status": "completed",
    }
    return _response([_with_tokens(item, request)])


def _user_text_and_tool_output(request: dict[str, Any]) -> tuple[str, bool]:
    items = request.get("input")
    if isinstance(items, str):
        return items, False
    text, tool_output = "", False
    for item in items or []:
        if not isinstance(item, dict):
            continue
        if item.get("role") == "user" and isinstance(item.get("content"), str):
            text = item["content"]
        if item.get("type") == "function_call_output":
            tool_output = True
    return text, tool_output


class ModelProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.record: list[Any] | None = None  # the call open on this connection
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next_request()

    def eof_received(self) -> bool:
        self._caller_left()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._caller_left()

    def _caller_left(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.record is not None:
            CALLS.end(self.record, "cut")
            self.record = None

    def _next_request(self) -> None:
        if self.record is not None:  # one call at a time on a connection (no pipelining here)
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        if len(self.buffer) < end + 4 + length:
            return
        body = self.buffer[end + 4 : end + 4 + length]
        self.buffer = self.buffer[end + 4 + length :]
        method, target = head[0].split(" ")[:2]
        if method == "GET":
            self._control(target)
            self._next_request()
            return
        request = json.loads(body)
        text, tool_output = _user_text_and_tool_output(request)
        row = ROW.search(text)
        think = THINK.search(text)
        record = CALLS.start(int(row[1]) if row else -1, 2 if tool_output else 1)
        answer = _message(request) if tool_output else _weather_call(request)
        delay = float(think[1]) if think else 0.0
        if delay <= 0:
            CALLS.end(record, "answered")
            self._send(200, answer)
            return
        self.record = record
        self.timer = asyncio.get_running_loop().call_later(delay, self._answer, answer)

    def _answer(self, answer: bytes) -> None:
        self.timer = None
        if self.record is not None:
            CALLS.end(self.record, "answered")
            self.record = None
        self._send(200, answer)
        self._next_request()

    def _control(self, target: str) -> None:
        if target.startswith("/stats"):
            stats = {"open": CALLS.open, "answered": CALLS.answered, "cut": CALLS.cut}
            self._send(200, json.dumps(stats).encode())
        elif target.startswith("/calls"):
            self._send(200, json.dumps(CALLS.records).encode())
        elif target.startswith("/reset"):
            CALLS.records = []
            self._send(200, b"{}")
        else:  # /v1/models and anything else Gym may probe
            self._send(200, b'{"object": "list", "data": [{"id": "stub", "object": "model"}]}')

    def _send(self, status: int, body: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        head = (
            f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        self.transport.write(head + body)


async def main(sock: socket.socket) -> None:
    server = await asyncio.get_running_loop().create_server(ModelProtocol, sock=sock, backlog=4096)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    Path(sys.argv[1]).write_text(str(listener.getsockname()[1]))  # once it accepts connections
    asyncio.run(main(listener))
