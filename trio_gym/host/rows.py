"""The per-row answer: one NDJSON line per finished example.

``200``, ``Content-Type: application/x-ndjson``, chunked. While the batch runs, an empty line is
the heartbeat. Each example that finishes sends its own line at once, in completion order:
``{"index": i, "result": {...}}``, or a *sidecar row* ``{"index": i, "error": {code, message},
"record": {...}}`` when that example failed, carrying its failure record (Gym's, or the host's
naming the failure) — one example's failure never ends the stream and cancels nothing else.
The last line is ``{"done": true, "completed": n, "failed": m}``, or ``{"done": true, "error":
{...}}`` when the batch as a whole was stopped (deadline, shutdown); examples without a line did
not finish. A caller that stops reading stalls the next line's
write, is given up after ``send_timeout_s``, and every example still running is cancelled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any, Final

import trio

from trio_gym.errors import ErrorCode, WireError, leaves
from trio_gym.http import ConnectionLost, encode_json
from trio_gym.protocol.rollouts import NDJSON_MEDIA, SIDECAR_RECORD_FIELD
from trio_gym.runners.base import Delivery

from .batch import (
    ExampleFailed,
    deliver,
    describe_failure,
    run_examples,
)
from .batch_state import Batch, BatchState
from .episodes import LiveEpisode
from .state import Services
from .supervision import Caller, supervise

# A stream's heartbeat: an empty line, which every NDJSON reader skips.
ROW_HEARTBEAT: Final = b"\n"


def row_line(index: int, result: Any, max_bytes: int) -> tuple[bytes, bool]:
    """The line for a finished example, and whether it is a result (not a sidecar row).

    A result that is not JSON, or whose line would exceed ``max_bytes``, becomes a sidecar row
    that says so: the stream goes on.
    """
    try:
        line = encode_json({"index": index, "result": result})
    except (TypeError, ValueError, RecursionError) as exc:
        error = WireError(ErrorCode.INTERNAL, f"the result of example {index} is not JSON: {exc}")
        return sidecar_line(index, error), False
    if len(line) > max_bytes:
        error = WireError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"the result of example {index} is {len(line)} bytes, over max_response_bytes="
            f"{max_bytes} (NMP_MAX_RESPONSE_BYTES)",
        )
        return sidecar_line(index, error), False
    return line + b"\n", True


def sidecar_line(
    index: int, error: WireError, record: Any = None, max_bytes: float = math.inf
) -> bytes:
    """A failed (or refused) example's line: its error, and its failure record if it ran —
    unless the record is not JSON or would make the line longer than ``max_bytes`` (the error
    says so)."""
    if record is None:
        return encode_json({"index": index, **error.envelope()}) + b"\n"
    try:
        line = encode_json({"index": index, **error.envelope(), SIDECAR_RECORD_FIELD: record})
    except (TypeError, ValueError, RecursionError) as exc:
        why = f"; its failure record is not JSON ({exc})"
    else:
        if len(line) < max_bytes:
            return line + b"\n"
        why = f"; its failure record ({len(line)} bytes) is over max_response_bytes={max_bytes}"
    noted = WireError(error.code, error.message + why, status=error.status)
    return encode_json({"index": index, **noted.envelope()}) + b"\n"


async def answer_with_rows(
    services: Services,
    caller: Caller,
    batch: Batch,
    examples: Sequence[dict[str, Any]],
    admitted: Sequence[LiveEpisode | WireError],
    deadline_s: float,
    row_offset: int,
) -> None:
    """Stream one line per finished example, then the ``done`` line. An example refused at
    admission (``admission_closed``, ``stale_attempt``) is a sidecar row at once. What a
    finished example registered for after its delivery runs once its line is written.

    Raises :class:`~trio_gym.http.ConnectionLost` if the caller left or stopped reading.
    """
    body = await caller.start(200, content_type=NDJSON_MEDIA, heartbeat=ROW_HEARTBEAT)
    counts = {"completed": 0, "failed": 0}
    limit = services.config.max_response_bytes
    # Rows go through one writer, outside the examples' cancel scope: a row finished before
    # the deadline or a shutdown is still delivered, and counted only once it is written.
    rows_in, rows_out = trio.open_memory_channel[tuple[bytes, bool, Sequence[Delivery]]](math.inf)
    for index, entry in enumerate(admitted):
        if isinstance(entry, WireError):
            rows_in.send_nowait((sidecar_line(index, entry), False, ()))

    def finished(index: int, result: Any, deliveries: Sequence[Delivery]) -> None:
        line, ok = row_line(index, result, limit)
        rows_in.send_nowait((line, ok, deliveries if ok else ()))

    def failed(index: int, failure: ExampleFailed) -> None:
        error = WireError(failure.code, describe_failure(failure))
        rows_in.send_nowait((sidecar_line(index, error, failure.record, limit), False, ()))

    episodes = [entry for entry in admitted if isinstance(entry, LiveEpisode)]
    work = partial(run_examples, services, examples, episodes, finished, failed, row_offset)

    async def write_rows() -> None:
        async for line, ok, deliveries in rows_out:
            await body.send(line)
            counts["completed" if ok else "failed"] += 1
            deliver(deliveries)

    async def run_and_close() -> WireError | None:
        with rows_in:
            return await supervise(
                services,
                caller,
                body,
                batch,
                heartbeat=ROW_HEARTBEAT,
                deadline_s=deadline_s,
                work=work,
            )

    stopped: WireError | None = None
    caller_lost: ConnectionLost | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_rows)
            stopped = await run_and_close()
    except* ConnectionLost as group:
        caller_lost = leaves(group)[0]
    if caller_lost is not None:
        raise caller_lost
    if stopped is None:
        batch.advance(BatchState.ANSWERING, **counts)
        await body.send(encode_json({"done": True, **counts}) + b"\n")
    else:
        batch.advance(BatchState.FAILING, code=stopped.code.value, **counts)
        await body.send(encode_json({"done": True, **stopped.envelope()}) + b"\n")
    await body.finish()
    batch.advance(BatchState.DONE if stopped is None else BatchState.FAILED)
