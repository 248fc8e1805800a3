"""An OpenAI-compatible model server on loopback for the real NeMo Gym suite: it answers at once.

Gym's ``openai_model`` server calls ``POST {policy_base_url}/responses``; this serves it (and
``GET /models``, which Gym's readiness probe reaches). What it answers depends on the last user
message of the request:

- contains ``[fail]``: HTTP 500 (the model rejects the call; Gym's agent fails);
- contains ``[hang]``: no answer until the caller hangs up (counted in ``disconnects``);
- contains ``[slow S]``: each call is answered as below, ``S`` seconds late;
- contains ``[no-tool]``: a plain message, so the ``get_weather`` verifier rewards 0;
- otherwise: a ``get_weather`` call first, then, once the tool's output is in the input, a plain
  message — the verifier rewards 1.

Like a vLLM policy, the output item it generates carries ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs`` (what Gym's token-ID capture records), unless
the last user message contains ``[no-tokens]``. Its "tokenizer" gives each input or output item
the same ids wherever it appears, so a continuation's prompt extends its parent's prompt and
generation, as a real policy's does.

``GET /stats`` answers its counters (calls, calls in flight, callers that hung up), so a test in
another process can read them. Run on its own, ``python -m tests.stub_model PORT_FILE`` listens
on a free loopback port and writes the port to ``PORT_FILE``.

Written with h11 directly, like ``tests/fake_gym.py``: it tests the project, so it does not use it.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

import trio

from tests.fake_gym import LoopbackServer, read_request, respond

_ids = itertools.count()


def _item_tokens(item: dict[str, Any]) -> list[int]:
    """The ids one item stands for: the same for an item generated and for it echoed back."""
    kind = item.get("type") or "message"
    if kind == "function_call":
        text = f"call {item.get('name')} {item.get('arguments')}"
    elif kind == "function_call_output":
        text = f"output {item.get('output')}"
    else:
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(
                str(part.get("text", "")) for part in content if isinstance(part, dict)
            )
        text = f"{item.get('role', 'assistant')} {content}"
    return [3 + byte % 250 for byte in text.encode()[:24]]


def _prompt_tokens(request: dict[str, Any]) -> list[int]:
    items = request.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return [token for item in items or [] if isinstance(item, dict) for token in _item_tokens(item)]


def _with_tokens(item: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    generated = _item_tokens(item)
    return {
        **item,
        "prompt_token_ids": _prompt_tokens(request),
        "generation_token_ids": generated,
        "generation_log_probs": [-0.5] * len(generated),
    }


def _response(output: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": f"resp-{next(_ids)}",
        "created_at": 1.0,
        "model": "stub",
        "object": "response",
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "output": output,
    }


def _message(text: str) -> dict[str, Any]:
    return {
        "id": f"msg-{next(_ids)}",
        "content": [{"annotations": [], "text": text, "type": "output_text"}],
        "role": "assistant",
        "status": "completed",
        "type": "message",
    }


def _weather_call() -> dict[str, Any]:
    return {
        "id": f"fc-{next(_ids)}",
        "call_id": f"call-{next(_ids)}",
        "name": "get_weather",
        "arguments": '{"city": "San Francisco"}',
        "type": "function_call",
        "status": "completed",
    }


def _last_user_text(request: dict[str, Any]) -> str:
    items = request.get("input")
    if isinstance(items, str):
        return items
    texts = [
        item["content"]
        for item in items or []
        if isinstance(item, dict)
        and item.get("role") == "user"
        and isinstance(item["content"], str)
    ]
    return texts[-1] if texts else ""


def _has_tool_output(request: dict[str, Any]) -> bool:
    items = request.get("input")
    return isinstance(items, list) and any(
        isinstance(item, dict) and item.get("type") == "function_call_output" for item in items
    )


class StubModel(LoopbackServer):
    """Serves the model on loopback; counts calls, calls in flight and callers that hung up."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.running = 0
        self.disconnects = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def handle(self, stream: trio.abc.Stream) -> None:
        try:
            head, body = await read_request(stream)
        except (EOFError, trio.BrokenResourceError):
            return
        if head.method == b"GET" and head.target == b"/stats":
            stats = {"calls": self.calls, "running": self.running, "disconnects": self.disconnects}
            await respond(stream, 200, json.dumps(stats).encode())
            return
        if head.method == b"GET":
            await respond(stream, 200, b'{"object": "list", "data": [{"id": "stub"}]}')
            return
        request = json.loads(body)
        text = _last_user_text(request)
        self.calls += 1
        self.running += 1
        self._note()
        try:
            if "[hang]" in text:
                await self._hang_until_the_caller_leaves(stream)
            elif "[fail]" in text:
                await respond(stream, 500, b'{"error": {"message": "the stub model refuses"}}')
            else:
                slow = re.search(r"\[slow ([0-9.]+)\]", text)
                if slow:
                    await trio.sleep(float(slow.group(1)))
                if "[no-tool]" in text or _has_tool_output(request):
                    item = _message("Sunny.")
                else:
                    item = _weather_call()
                if "[no-tokens]" not in text:
                    item = _with_tokens(item, request)
                await respond(stream, 200, json.dumps(_response([item])).encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.running -= 1
            self._note()

    async def _hang_until_the_caller_leaves(self, stream: trio.abc.Stream) -> None:
        try:
            while await stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.disconnects += 1


async def _main(port_file: Path) -> None:
    model = StubModel()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(model.serve)
        await trio.Path(port_file).write_text(str(port))


if __name__ == "__main__":
    trio.run(_main, Path(sys.argv[1]))
