"""``POST /rollouts/run`` (DESIGN §3.3): validate, run the batch under supervision, answer.

The batch runs in one nursery beside

- a heartbeat: one single-space chunk every ``heartbeat_interval_s`` (HTTP/1.1 only), so
  proxies see bytes long before the batch ends, and a write to a departed caller fails;
- a caller watcher: a reset means the caller is gone; an end-of-file may be a half-close (the
  caller shut down its writing side and still reads), so it is probed with two heartbeats a
  round trip apart: a peer that is really gone answers the first with a reset and fails the
  second;
- a shutdown watcher: when the host stops, the batch is cancelled and answered
  ``shutting_down``.

When the caller is gone, the nursery is cancelled and with it every running example; nothing
is left running. The deadline is a cancel scope around the examples alone, so a batch that
outlives it is cancelled and still answered (``deadline_exceeded``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Annotated, Any, Final

import attrs
import h11
import pydantic
import trio
from pydantic import BaseModel, ConfigDict, Field

from trio_gym.config import describe_validation_error
from trio_gym.errors import ErrorCode, WireError, leaves
from trio_gym.http import (
    ChunkedBody,
    ConnectionLost,
    HttpConnection,
    encode_json,
    read_body,
    send_body,
)
from trio_gym.runners import Runner

from .batch import (
    Batch,
    BatchState,
    ExampleFailed,
    ResultsInfo,
    coalesce,
    encode_results,
    internal_error,
    run_examples,
)
from .state import Host, new_batch_id

HEARTBEAT: Final = b" "
# Two probe writes this far apart tell a half-closed caller from a departed one when the round
# trip is shorter (loopback and in-region links are well under it); for longer round trips the
# next heartbeat write notices instead, within one more interval.
PROBE_DELAY_S: Final = 0.2

# Bodies above this are parsed and checked in a worker thread: a 59 MB body takes about 4 s of
# CPU, which would stall every other connection's heartbeats and /health. Below it a thread hop
# costs more than the work (and keeps virtual clocks in tests exact).
THREAD_PARSE_BYTES: Final = 1024 * 1024

TOO_LARGE_ADVICE: Final = (
    "send fewer examples per request, or raise max_request_bytes (NMP_MAX_REQUEST_BYTES)"
)


class RolloutRequest(BaseModel):
    """The request body: ``{"examples": [{...}, ...], "deadline_s": <optional seconds>}``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    examples: list[dict[str, Any]]
    deadline_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_rollout_request(body: bytes) -> RolloutRequest:
    """Decode and validate the body; raises ``invalid_request`` saying exactly what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(
            ErrorCode.INVALID_REQUEST,
            f"the body is not UTF-8 (invalid byte at offset {exc.start}); send UTF-8 JSON",
        ) from exc
    if not text.strip():
        raise WireError(ErrorCode.INVALID_REQUEST, 'the body is empty; send {"examples": [...]}')
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise WireError(ErrorCode.INVALID_REQUEST, f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise WireError(
            ErrorCode.INVALID_REQUEST, "the body's JSON is nested too deeply to be an example"
        ) from exc
    if not isinstance(data, dict):
        raise WireError(
            ErrorCode.INVALID_REQUEST,
            f'the body must be a JSON object {{"examples": [...]}}, not {type(data).__name__}',
        )
    try:
        return RolloutRequest.model_validate(data)
    except pydantic.ValidationError as exc:
        raise WireError(ErrorCode.INVALID_REQUEST, describe_validation_error(exc)) from exc


def validate_batch(body: bytes, runner: Runner) -> RolloutRequest:
    """Parse the body and let the runner check every example; ``invalid_request`` otherwise."""
    request = parse_rollout_request(body)
    for index, example in enumerate(request.examples):
        try:
            runner.check_example(example)
        except ValueError as exc:
            raise WireError(ErrorCode.INVALID_REQUEST, f"examples[{index}]: {exc}") from exc
    return request


@attrs.frozen
class Answer:
    """The document that answers a batch, as byte pieces, and its status when buffered."""

    pieces: list[bytes]
    status: int = 200
    error: ErrorCode | None = None

    @classmethod
    def failure(cls, error: WireError) -> Answer:
        return cls([encode_json(error.envelope())], error.status, error.code)


async def answer_rollouts(host: Host, conn: HttpConnection, head: h11.Request) -> None:
    """Answer one ``POST /rollouts/run``.

    Refusals before the status line (503, 400, 408, 413) are raised as :class:`WireError` for
    the caller to send; once the status line has left, every failure goes into the document.
    Returns quietly if the caller left (the batch is logged ``abandoned``).
    """
    host.check_accepting()
    body = await read_body(
        conn,
        head,
        max_bytes=host.config.max_request_bytes,
        idle_timeout_s=host.limits.read_timeout_s,
        min_rate=host.limits.min_body_rate,
        advice=TOO_LARGE_ADVICE,
    )
    if len(body) > THREAD_PARSE_BYTES:
        request = await trio.to_thread.run_sync(validate_batch, body, host.runner)
    else:
        request = validate_batch(body, host.runner)
    host.check_accepting()  # the body may have taken a while; the host may be stopping now

    deadline_s = min(request.deadline_s or math.inf, host.config.rollout_deadline_s)
    batch = Batch(new_batch_id(), len(request.examples))
    batch.advance(
        BatchState.RUNNING,
        http_version=(conn.their_http_version or b"").decode(),
        deadline_s=deadline_s,
    )
    host.stats.batches_running += 1
    try:
        await _run_and_answer(host, conn, batch, request.examples, deadline_s)
    except ConnectionLost as exc:
        batch.advance(BatchState.ABANDONED, reason=str(exc))
    finally:
        host.stats.batches_running -= 1


async def _run_and_answer(
    host: Host,
    conn: HttpConnection,
    batch: Batch,
    examples: Sequence[dict[str, Any]],
    deadline_s: float,
) -> None:
    """HTTP/1.1: the status line now, heartbeats while the batch runs, the document as chunks.
    HTTP/1.0 has no chunked framing, hence no heartbeats: one answer behind Content-Length."""
    body = None
    if conn.their_http_version == b"1.1":
        body = await ChunkedBody.start(conn, 200, content_type="application/json")
    answer = await _supervise(host, conn, examples, batch.id, deadline_s, body)
    if answer.error is None:
        batch.advance(BatchState.ANSWERING)
    else:
        batch.advance(BatchState.FAILING, code=answer.error.value)
    if body is None:
        document = b"".join(answer.pieces)
        await send_body(conn, answer.status, document, content_type="application/json")
    else:
        for run in coalesce(answer.pieces):
            await body.send(run)
        await body.finish()
    batch.advance(BatchState.DONE if answer.error is None else BatchState.FAILED)


async def _supervise(
    host: Host,
    conn: HttpConnection,
    examples: Sequence[dict[str, Any]],
    batch_id: str,
    deadline_s: float,
    body: ChunkedBody | None,
) -> Answer:
    """Run the batch beside its heartbeat and watchers.

    Returns the answer to send. Raises :class:`ConnectionLost` if the caller left, after every
    example was cancelled.
    """
    if not examples:
        return await _document(host, [])
    examples_scope = trio.CancelScope(deadline=trio.current_time() + deadline_s)
    caller_lost: ConnectionLost | None = None
    answer = Answer([])
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_caller, conn, body)
            nursery.start_soon(_cancel_on_shutdown, host, examples_scope)
            if body is not None:
                nursery.start_soon(_send_heartbeats, body, host.config.heartbeat_interval_s)
            answer = await _run(host, examples, batch_id, examples_scope, deadline_s)
            nursery.cancel_scope.cancel()
    except* ConnectionLost as group:
        caller_lost = leaves(group)[0]
    if caller_lost is not None:
        raise caller_lost
    return answer


async def _run(
    host: Host,
    examples: Sequence[dict[str, Any]],
    batch_id: str,
    examples_scope: trio.CancelScope,
    deadline_s: float,
) -> Answer:
    failures: list[ExampleFailed] = []
    results: list[Any] = []
    with examples_scope:
        try:
            results = await run_examples(host.runner, examples, batch_id, host.stats)
        except* ExampleFailed as group:
            failures = leaves(group)
    if failures:
        return Answer.failure(internal_error(failures))
    if examples_scope.cancelled_caught:
        if host.shutdown_requested.is_set():
            return Answer.failure(
                WireError(
                    ErrorCode.SHUTTING_DOWN,
                    "the host is shutting down; every example of this batch was cancelled",
                )
            )
        return Answer.failure(
            WireError(
                ErrorCode.DEADLINE_EXCEEDED,
                f"the batch of {len(examples)} examples outlived its deadline of {deadline_s:g} s "
                "and its unfinished examples were cancelled; send fewer or shorter examples per "
                "request, or a larger deadline_s (capped by NMP_ROLLOUT_DEADLINE_S)",
            )
        )
    return await _document(host, results)


async def _document(host: Host, results: list[Any]) -> Answer:
    info = ResultsInfo(
        job_id=host.config.job_id,
        environment_path=host.config.environment_path,
        work_path=host.config.work_path,
    )
    limit = host.config.max_response_bytes
    try:
        return Answer(await encode_results(results, info, limit))
    except WireError as error:
        return Answer.failure(error)


async def _send_heartbeats(body: ChunkedBody, interval_s: float) -> None:
    while True:
        await trio.sleep(interval_s)
        await body.send(HEARTBEAT)


async def _watch_caller(conn: HttpConnection, body: ChunkedBody | None) -> None:
    """Raise :class:`ConnectionLost` once the caller is known to be gone; return when nothing
    more can be learned by watching."""
    await conn.wait_until_peer_stops_sending()
    if body is None:
        # HTTP/1.0: no byte may be written before the answer, so a half-closed caller and a
        # departed one cannot be told apart; a reset is still noticed, the deadline bounds the rest.
        return
    await body.send(HEARTBEAT)
    await trio.sleep(PROBE_DELAY_S)
    await body.send(HEARTBEAT)


async def _cancel_on_shutdown(host: Host, examples_scope: trio.CancelScope) -> None:
    await host.shutdown_requested.wait()
    examples_scope.cancel()
