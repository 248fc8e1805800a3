"""``POST /rollouts/run``: refuse early, validate, run under supervision, answer.

Two answers: one JSON document (the default; HTTP/1.1 chunked with single-space heartbeats, or
HTTP/1.0 buffered), or, with ``Accept: application/x-ndjson``, a per-row stream (:mod:`.rows`).
The supervision both share is in :mod:`.supervision`. A document fails as a whole when one
example fails, as the upstream host's does, unless the request asks for ``"failures":
"records"``: then each failed example's failure record takes its place among the results
(:mod:`trio_gym.protocol.rollouts`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import partial
from typing import Any, Final

import attrs
import pydantic
import trio

from trio_gym.errors import ErrorCode, WireError, bounded, describe_validation_error, leaves
from trio_gym.http import (
    ConnectionLost,
    HttpConnection,
    encode_json,
    read_body,
    send_json,
)
from trio_gym.http.h11_build import h11
from trio_gym.protocol.identity import EpisodeId
from trio_gym.protocol.rollouts import (
    IDEMPOTENCY_KEY_HEADER,
    JSON_MEDIA,
    NDJSON_MEDIA,
    RolloutRequest,
)
from trio_gym.runners import Runner
from trio_gym.runners.base import Delivery

from .batch import (
    ExampleFailed,
    ResultsDocument,
    batch_error,
    coalesce,
    deliver,
    run_examples,
)
from .batch_state import Batch, BatchState
from .episodes import LiveEpisode
from .keys import idempotency_key
from .reattach import request_digest
from .rows import answer_with_rows
from .state import Services
from .supervision import Caller, ConnectionCaller, supervise

# A document's heartbeat: JSON whitespace, so heartbeats plus the document parse as one value.
HEARTBEAT: Final = b" "

# Bodies above this are parsed and checked in a worker thread: a 59 MB body takes about 4 s of
# CPU, which would stall every other connection's heartbeats and /health. Below it a thread hop
# costs more than the work (and keeps virtual clocks in tests exact).
THREAD_PARSE_BYTES: Final = 1024 * 1024

TOO_LARGE_ADVICE: Final = (
    "send fewer examples per request, or raise max_request_bytes (NMP_MAX_REQUEST_BYTES)"
)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER: Final = json.JSONDecoder(parse_constant=_refuse_constant)


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
        data = _DECODER.decode(text)
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


def validate_batch(
    body: bytes, runner: Runner, batch_id: str, *, refuse_whole: bool, identities: bool
) -> tuple[RolloutRequest, list[EpisodeId | WireError]]:
    """Parse the body, let the runner check every example, and name each one's episode.

    With ``identities`` (the checkpoint control plane on) an episode is the identity the row
    carries (a rollout id assigned where it has none), and two rows of one identity in a batch
    are ``invalid_request`` naming both. Without, every row is an episode of its own, as the
    upstream host runs them, whatever identity keys it carries.

    A malformed body is ``invalid_request``. A malformed example is too when ``refuse_whole``
    (a document answers the whole batch); otherwise (a row stream) its entry is the refusal,
    for a sidecar row, and the other examples run.
    """
    request = parse_rollout_request(body)
    checked: list[EpisodeId | WireError] = []
    first_of: dict[str, int] = {}
    for index, example in enumerate(request.examples):
        assigned = f"{batch_id}-{index}"
        try:
            runner.check_example(example)
            episode = EpisodeId.of(example, assigned) if identities else EpisodeId(assigned, 0)
        except ValueError as exc:
            refusal = WireError(
                ErrorCode.INVALID_REQUEST, f"examples[{index}]: {bounded(str(exc))}"
            )
            if refuse_whole:
                raise refusal from exc
            checked.append(refusal)
            continue
        twin = first_of.setdefault(episode.capture_key, index)
        if twin != index:
            raise WireError(
                ErrorCode.INVALID_REQUEST,
                f"examples[{twin}] and examples[{index}] are one episode "
                f"({bounded(episode.capture_key, 200)}); give each row its own _ng_rollout_id "
                "(or _ng_task_index/_ng_rollout_index)",
            )
        checked.append(episode)
    return request, checked


@attrs.frozen
class Answer:
    """The document that answers a batch, as byte pieces, and its status when buffered."""

    pieces: list[bytes]
    status: int = 200
    error: ErrorCode | None = None

    @classmethod
    def failure(cls, error: WireError) -> Answer:
        return cls([encode_json(error.envelope())], error.status, error.code)


def wants_rows(head: h11.Request) -> bool:
    """True if the caller asked for the per-row NDJSON stream (``Accept: application/x-ndjson``)."""
    accept = b",".join(value for name, value in head.headers if name == b"accept")
    return any(
        part.split(b";")[0].strip().lower() == NDJSON_MEDIA.encode() for part in accept.split(b",")
    )


async def answer_rollouts(services: Services, conn: HttpConnection, head: h11.Request) -> None:
    """Answer one ``POST /rollouts/run``.

    Refusals before the status line (503, 400, 406, 408, 413) are raised as :class:`WireError`
    for the caller to send; once the status line has left, every failure goes into the answer.
    Without an ``Idempotency-Key`` it returns quietly if the caller left (the batch is logged
    ``abandoned``). The batch runs in this task either way; under a key it writes its answer
    into a log its callers read (:mod:`.reattach`), and this task holds it while one may come
    back for it.
    """
    services.lifecycle.check_accepting()
    rows = wants_rows(head)
    if rows and conn.their_http_version != b"1.1":
        raise WireError(
            ErrorCode.NOT_ACCEPTABLE,
            f"{NDJSON_MEDIA} is a stream and needs HTTP/1.1 chunked framing; send HTTP/1.1, "
            f"or ask for {JSON_MEDIA}",
        )
    key = idempotency_key(head)
    body = await read_body(
        conn,
        head,
        max_bytes=services.config.max_request_bytes,
        idle_timeout_s=services.limits.read_timeout_s,
        min_rate=services.limits.min_body_rate,
        advice=TOO_LARGE_ADVICE,
    )
    if key is None:
        await run_batch(services, ConnectionCaller(conn), Batch(), body, rows)
        return
    keyed = services.keyed
    digest = request_digest(body, rows=rows, http_version=conn.their_http_version or b"")
    found = keyed.find(key, digest)
    if found is not None:
        await keyed.attach(found, conn)
        return
    batch = Batch(key=key)
    await keyed.run(
        key, batch, digest, conn, lambda caller: run_batch(services, caller, batch, body, rows)
    )


async def cancel_keyed(services: Services, conn: HttpConnection, head: h11.Request) -> None:
    """``DELETE /rollouts/run`` with the ``Idempotency-Key`` of a batch: its caller gives it up
    for good (a cancelled trainer), so it is cancelled now, not after the grace."""
    key = idempotency_key(head)
    if key is None:
        raise WireError(
            ErrorCode.INVALID_REQUEST,
            f"DELETE /rollouts/run cancels the batch named by its {IDEMPOTENCY_KEY_HEADER} "
            "header; send one",
        )
    await read_body(
        conn,
        head,
        max_bytes=services.limits.max_head_bytes,
        idle_timeout_s=services.limits.read_timeout_s,
        min_rate=services.limits.min_body_rate,
        advice="send no body",
    )
    await send_json(conn, 200, {"key": key, "cancelled": services.keyed.cancel(key)})


async def run_batch(
    services: Services, caller: Caller, batch: Batch, body: bytes, rows: bool
) -> None:
    """Validate, admit and run ``batch``, answering ``caller``; refusals before the status
    line are raised as :class:`WireError`. A bug leaves naming the batch (a note on it: the
    connection's boundary logs it)."""
    admitted: list[LiveEpisode | WireError] = []
    try:
        validate = partial(
            validate_batch,
            body,
            services.lifecycle.runner,
            batch.id,
            refuse_whole=not rows,
            identities=services.tracks_episodes,
        )
        if len(body) > THREAD_PARSE_BYTES:
            request, checked = await trio.to_thread.run_sync(validate)
        else:
            request, checked = validate()
        # The body may have taken a while; the host may be stopping now, or its caller gone.
        services.lifecycle.check_accepting()
        batch.check_still_wanted()
        services.check_batch_room()  # then nothing waits until it is counted
        admitted = [
            entry
            if isinstance(entry, WireError)
            else services.episodes.admit_or_refuse(entry, batch.id, index, batch.deadline)
            for index, entry in enumerate(checked)
        ]
        if not rows:
            refuse_unless_all_admitted(admitted)
        deadline_s = min(request.deadline_s or math.inf, services.config.rollout_deadline_s)
        batch.size = len(request.examples)
        batch.advance(
            BatchState.RUNNING,
            http_version=caller.http_version.decode(),
            mode="rows" if rows else "document",
            deadline_s=deadline_s,
        )
        services.stats.batches_running += 1
        try:
            if rows:
                await answer_with_rows(
                    services,
                    caller,
                    batch,
                    request.examples,
                    admitted,
                    deadline_s,
                    request.row_offset,
                )
            else:
                episodes = [live for live in admitted if isinstance(live, LiveEpisode)]
                await _answer_with_document(services, caller, batch, request, episodes, deadline_s)
        except ConnectionLost as exc:
            batch.advance(BatchState.ABANDONED, reason=str(exc))
        finally:
            batch.log_cut()  # when it ended before its answer did
            services.stats.batches_running -= 1
            services.stats.batches_finished[batch.outcome] += 1
            services.stats.batch_changes.note()
    except Exception as exc:
        if not isinstance(exc, WireError | ConnectionLost):
            exc.add_note(f"in {batch.named}")
        raise
    finally:
        for live in admitted:
            if isinstance(live, LiveEpisode):
                services.episodes.end(live)  # idempotent: whatever did not end by itself


def refuse_unless_all_admitted(admitted: Sequence[LiveEpisode | WireError]) -> None:
    """A document answers a whole batch: one refused example refuses it (stale first, as
    retrying cannot help it; then admission_closed, which a retry after the checkpoint can)."""
    refusals = [entry for entry in admitted if isinstance(entry, WireError)]
    if refusals:
        refusals.sort(key=lambda error: error.code is not ErrorCode.STALE_ATTEMPT)
        raise refusals[0]


async def _answer_with_document(
    services: Services,
    caller: Caller,
    batch: Batch,
    request: RolloutRequest,
    episodes: Sequence[LiveEpisode],
    deadline_s: float,
) -> None:
    """HTTP/1.1: the status line now, heartbeats while the batch runs, the document as chunks.
    HTTP/1.0 has no chunked framing, hence no heartbeats: one answer behind Content-Length.
    One failed example fails the batch (``internal``) and cancels its siblings — unless the
    request asked for failure records, which then take the failed examples' places. What the
    examples registered for after their delivery runs once the whole document is written."""
    body = None
    if caller.http_version == b"1.1":
        body = await caller.start(200, content_type=JSON_MEDIA, heartbeat=HEARTBEAT)
    examples = request.examples
    document = ResultsDocument(
        len(examples), services.results_info, services.config.max_response_bytes
    )
    failures: list[ExampleFailed] = []
    deliveries: list[Delivery] = []

    def finished(index: int, result: Any, delivered: Sequence[Delivery]) -> None:
        document.add(index, result)
        deliveries.extend(delivered)

    def failed_in_place(index: int, failure: ExampleFailed) -> None:
        document.add(index, failure.record)

    failed = failed_in_place if request.failures == "records" else None

    async def work() -> None:
        nonlocal failures
        try:
            await run_examples(services, examples, episodes, finished, failed, request.row_offset)
        except* ExampleFailed as group:
            failures = leaves(group)

    stopped = await supervise(
        services, caller, body, batch, heartbeat=HEARTBEAT, deadline_s=deadline_s, work=work
    )
    if failures:
        answer = Answer.failure(batch_error(failures))
    elif stopped is not None:
        answer = Answer.failure(stopped)
    else:
        try:
            answer = Answer(document.pieces())
        except WireError as error:
            answer = Answer.failure(error)
    if answer.error is None:
        batch.advance(BatchState.ANSWERING)
    else:
        batch.advance(BatchState.FAILING, code=answer.error.value)
    if body is None:
        await caller.send_whole(answer.status, b"".join(answer.pieces), content_type=JSON_MEDIA)
    else:
        runs = coalesce(answer.pieces)  # one run at a time: a large document is not copied
        held_back = next(runs)
        for run in runs:
            await body.send(held_back)
            held_back = run
        await body.finish(held_back)  # the last run and the end of the body in one write
    batch.advance(BatchState.DONE if answer.error is None else BatchState.FAILED)
    if answer.error is None:
        deliver(deliveries)
