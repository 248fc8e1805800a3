"""One batch: running its examples, and the document that answers it (its identity and
lifecycle: :mod:`.batch_state`)."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import trio

from trio_gym.errors import ErrorCode, WireError, bounded
from trio_gym.http import encode_json
from trio_gym.http.messages import BODY_PIECE_BYTES
from trio_gym.protocol.identity import (
    ATTEMPT_KEY,
    IDENTITY_KEYS,
    ROLLOUT_ID_KEY,
    EpisodeId,
    rollout_id_of,
)
from trio_gym.protocol.rollouts import (
    FAILURE_CLASS_KEY,
    FAILURE_MESSAGE_KEY,
    FAILURE_TYPE_KEY,
    RUNNER_ERROR,
    STALE_ATTEMPT,
    failure_identity,
)
from trio_gym.runners import ExampleContext
from trio_gym.runners.base import Delivery, RecordedFailure

from .episodes import LiveEpisode
from .state import ResultsInfo, Services

# The upstream host's bounds for a reported traceback: enough to find the failing line of a
# runner, small enough to read in a log viewer and to never crowd out the results.
TRACEBACK_FRAMES: Final = 20
TRACEBACK_CHARS: Final = 8000
HEADLINE_CHARS: Final = 2000


class ExampleFailed(Exception):
    """Example ``index`` failed: its runner raised, or (``stale_attempt``) it was retired.
    ``record`` is its failure record, identity carried (see :func:`failure_record`)."""

    def __init__(
        self,
        index: int,
        error: Exception,
        record: dict[str, Any],
        code: ErrorCode = ErrorCode.INTERNAL,
    ) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error
        self.record = record
        self.code = code


Finished = Callable[[int, Any, Sequence[Delivery]], None]
"""Told of each example that finished: its index, its result, and what to run once the result
has reached the caller."""


class AttemptRetired(Exception):
    """The control plane retired this attempt while it ran."""


async def run_examples(
    services: Services,
    examples: Sequence[Mapping[str, Any]],
    episodes: Sequence[LiveEpisode],
    finished: Finished,
    failed: Callable[[int, ExampleFailed], None] | None = None,
    row_offset: int = 0,
) -> None:
    """Run every admitted episode's example at once, each in its own task of one nursery (one
    alone in the caller's task);
    ``finished(index, result, deliveries)`` as each ends. ``row_offset`` is the position of the
    first example in the caller's whole input.

    With ``failed``, a failure is handed to it and the others run on (the per-row answer).
    Without, it raises :class:`ExampleFailed` in an ``ExceptionGroup`` (every other example is
    then cancelled), however many ran. Cancelling the caller cancels every example.
    """
    if len(episodes) == 1:
        # One example runs in this task, with no nursery: a held batch of one is the commonest,
        # and the nursery, its task and their scopes are a fifth of a held connection's memory
        # (NOTES.md). It fails as a nursery would: grouped.
        only = episodes[0]
        try:
            await run_example(services, examples[only.index], only, finished, failed, row_offset)
        except Exception as failure:
            raise ExceptionGroup("an example failed", [failure]) from None
        return
    async with trio.open_nursery() as nursery:
        for live in episodes:
            example = examples[live.index]
            nursery.start_soon(run_example, services, example, live, finished, failed, row_offset)


async def run_example(
    services: Services,
    example: Mapping[str, Any],
    episode: LiveEpisode,
    finished: Finished,
    failed: Callable[[int, ExampleFailed], None] | None,
    row_offset: int,
) -> None:
    """Run one admitted episode, count how it ended, and report it: ``finished(index, result,
    deliveries)`` with identity carried, or ``failed(index, failure)`` — raised instead when
    there is no ``failed`` — for a runner's failure, or ``stale_attempt`` when the control plane
    retired the attempt while it ran. (One function, no wrapper: every frame is kept by a held
    batch.) With the control plane on, a row that names no rollout reaches the runner with the
    one assigned to it, the id its result and its captures carry.
    """
    context = ExampleContext(
        episode.batch_id,
        episode.index,
        position=row_offset + episode.index,
        capture_key=episode.id.capture_key,
        restored=episode.restored.state if episode.restored is not None else None,
        hooks=services.episodes,
    )
    identity = episode.id if services.tracks_episodes else None
    if identity is not None and rollout_id_of(example) is None:
        example = {**example, ROLLOUT_ID_KEY: identity.rollout_id}
    episode.started = True
    services.stats.examples_started += 1
    started_at = trio.current_time()
    # Counted in `finally`: a runner with a nursery of its own ends a cancellation with a group
    # of Cancelled, which `except trio.Cancelled` would not see.
    outcome = "cancelled"
    failure: ExampleFailed | None = None
    try:
        with episode.scope:
            result = await services.lifecycle.runner.run_example(example, context)
            outcome = "completed"
    except Exception as exc:  # any runner failure is this example's failure, reported as such
        outcome = "failed"
        record = failure_record(example, context.position, exc, identity)
        failure = ExampleFailed(episode.index, exc, record)
        failure.__cause__ = exc
    finally:
        services.stats.count_end(
            outcome,
            trio.current_time() - started_at,
            None if failure is None else failure.record.get(FAILURE_CLASS_KEY),
        )
        services.episodes.end(episode)
    if failure is None and episode.scope.cancelled_caught:
        retired = AttemptRetired(f"{episode.id.capture_key} was retired while it ran")
        record = failure_record(example, context.position, retired, identity, STALE_ATTEMPT)
        failure = ExampleFailed(episode.index, retired, record, ErrorCode.STALE_ATTEMPT)
    if failure is None:
        finished(episode.index, carry_identity(example, result, identity), context.deliveries)
    elif failed is None:
        raise failure
    else:
        failed(episode.index, failure)


def deliver(deliveries: Sequence[Delivery]) -> None:
    """Tell finished examples that their results reached the caller."""
    for delivery in deliveries:
        delivery()


def carry_identity(example: Mapping[str, Any], result: Any, episode: EpisodeId | None) -> Any:
    """Copy identity onto an object result where the result lacks it (or has it as null).

    The example's ``_ng_task_index``, ``_ng_rollout_index``, ``_sg_example_id``,
    ``_ng_rollout_id`` and ``_ng_attempt_index`` when it has them; with an ``episode`` (the
    checkpoint control plane on), its ``_ng_rollout_id`` and ``_ng_attempt_index`` always (a
    rollout id may have been assigned here, and checkpoints need both). No other key is
    invented; a value the runner returned is never overwritten; a non-object result is left
    alone.
    """
    if not isinstance(result, dict):
        return result
    identity = {key: example[key] for key in IDENTITY_KEYS if example.get(key) is not None}
    if episode is not None:
        identity[ROLLOUT_ID_KEY] = episode.rollout_id
        identity[ATTEMPT_KEY] = episode.attempt
    missing = {key: value for key, value in identity.items() if result.get(key) is None}
    return {**result, **missing} if missing else result


def failure_record(
    example: Mapping[str, Any],
    position: int,
    error: Exception,
    episode: EpisodeId | None,
    failure_class: str = RUNNER_ERROR,
) -> Any:
    """The failure record of ``example`` (at ``position`` in the caller's input), failed with
    ``error``: the environment's own when the runner gave one
    (:class:`~trio_gym.runners.base.RecordedFailure`: Gym's), identity carried; else the
    host's, of ``failure_class``, naming the error (bounded as a headline is) and the row."""
    if isinstance(error, RecordedFailure):
        record = {**failure_identity(example, position), **error.record}
        return carry_identity(example, record, episode)
    record = {
        FAILURE_CLASS_KEY: failure_class,
        FAILURE_TYPE_KEY: type(error).__name__,
        FAILURE_MESSAGE_KEY: str(error)[:HEADLINE_CHARS],
        **failure_identity(example, position),
    }
    return carry_identity(example, record, episode)


def describe_failure(failure: ExampleFailed, note: str = "") -> str:
    """ "example i failed: Type: message", ``note``, the innermost frames; each part bounded."""
    error = failure.error
    headline = bounded(f"{type(error).__name__}: {error}", HEADLINE_CHARS)
    frames = "".join(traceback.format_tb(error.__traceback__, limit=-TRACEBACK_FRAMES))
    if len(frames) > TRACEBACK_CHARS:
        frames = "...\n" + frames[-TRACEBACK_CHARS:]
    return (
        f"example {failure.index} failed: {headline}{note}\n"
        f"Traceback (innermost {TRACEBACK_FRAMES} frames at most):\n{frames}"
    )


def batch_error(failures: Sequence[ExampleFailed]) -> WireError:
    """The error of a batch with failed examples: its first, and how many others failed."""
    first = min(failures, key=lambda failure: failure.index)
    others = f" ({len(failures) - 1} other example(s) failed too)" if len(failures) > 1 else ""
    return WireError(first.code, describe_failure(first, others))


class ResultsDocument:
    """The success document, built while the batch runs.

    Each result is encoded the moment its example finishes and only the bytes are kept, so a
    200 MiB document exists once, as bytes — not as the runner's objects plus an encoded copy
    — and encoding is spread over the batch instead of stalling every other connection at its
    end. A result that is not JSON is named by its example; the size limit is enforced as
    results arrive, and past it nothing more is kept.
    """

    def __init__(self, count: int, info: ResultsInfo, max_bytes: int) -> None:
        self._tail = info.encoded
        self._count = count
        self._parts: list[bytes] = [b""] * count
        # The opening, the commas, and the closing b"]," + tail[1:]: what pieces() will join.
        self._size = len(b'{"results":[') + max(0, count - 1) + len(self._tail) + 1
        self._max_bytes = max_bytes
        self._added = 0
        self._not_json: dict[int, str] = {}
        self._too_large_after: int | None = None

    def add(self, index: int, result: Any) -> None:
        self._added += 1
        try:
            encoded = encode_json(result)
        except (TypeError, ValueError, RecursionError) as exc:
            self._not_json[index] = str(exc)
            return
        if self._too_large_after is not None:
            return  # still encoded: a result that is not JSON outranks the size, whenever it comes
        self._size += len(encoded)
        if self._size > self._max_bytes:
            self._too_large_after = self._added
            self._parts = []
            return
        self._parts[index] = encoded

    def pieces(self) -> list[bytes]:
        """The document as byte pieces whose concatenation is one JSON object.

        Raises :class:`WireError` ``internal`` naming the first example (by index) whose result
        is not JSON — a bug outranks a size, and the answer must not depend on which example
        finished first — else ``payload_too_large`` (status 500: the request was fine, the
        answer is too big).
        """
        if self._not_json:
            index = min(self._not_json)
            raise WireError(
                ErrorCode.INTERNAL,
                f"the result of example {index} is not JSON: {self._not_json[index]}",
            )
        if self._too_large_after is not None:
            raise WireError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"the results document exceeds max_response_bytes={self._max_bytes} once "
                f"{self._too_large_after} of {self._count} results had arrived; send "
                "fewer examples per request (the trainer's chunk size) or raise "
                "max_response_bytes (NMP_MAX_RESPONSE_BYTES)",
                status=500,
            )
        pieces = [b'{"results":[']
        for index, part in enumerate(self._parts):
            if index:
                pieces.append(b",")
            pieces.append(part)
        pieces.append(b"]," + self._tail[1:])
        return pieces


def coalesce(pieces: Sequence[bytes], size: int = BODY_PIECE_BYTES) -> Iterator[bytes]:
    """Join small pieces into runs of about ``size`` bytes, so a document of ten thousand
    small results is a few hundred writes, not ten thousand."""
    run: list[bytes] = []
    length = 0
    for piece in pieces:
        run.append(piece)
        length += len(piece)
        if length >= size:
            yield b"".join(run)
            run, length = [], 0
    if run:
        yield b"".join(run)
