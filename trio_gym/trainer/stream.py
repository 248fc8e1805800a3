"""Reading a host's per-row NDJSON answer as it arrives: ``async for row in client.stream(...)``.

Each :class:`Row` is one finished example, in completion order: a result, or a sidecar error
for that example alone (with its failure record, as NeMo Gym's collection writes it, when it
ran). The stream ends at the host's ``done`` line (:attr:`RowStream.summary`);
a batch-level failure there (deadline, shutdown) is raised as a ``sandbox``
:class:`RolloutError` after the rows that did arrive. A stream that ends *without* its done line
was cut: named as the client names any cut answer (the host's ``/health`` asked at once:
``sandbox`` if it is gone, ``proxy`` if it lives). While the host lives, the stream reattaches
to the batch under the request's ``Idempotency-Key`` (at most ``max_reattaches`` times): the
host sends the answer again from its start, the rows already read are skipped, and the stream
goes on. Otherwise the cut is raised, counting the examples that never got a row, and taken
(the host had started them). Examples with no row did not finish; :attr:`RowStream.missing`
lists them.

Use it as ``async with client.stream(examples) as rows: async for row in rows: ...`` so the
connection is closed however the loop ends; a plain ``async for`` closes it when the stream is
exhausted or fails, and leaving such a loop early needs ``await rows.aclose()``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeGuard

import attrs

from trio_gym.http import BodyFailed, ClientExchange, NoResponse
from trio_gym.http.h11_build import h11
from trio_gym.logs import log_event
from trio_gym.protocol.rollouts import (
    IDEMPOTENCY_KEY_HEADER,
    JSON_MEDIA,
    NDJSON_MEDIA,
    RUN_PATH,
    SIDECAR_RECORD_FIELD,
    new_idempotency_key,
)
from trio_gym.trainer.answers import decode_response
from trio_gym.trainer.deadlines import RequestDeadline
from trio_gym.trainer.errors import Origin, Reach, RolloutError

if TYPE_CHECKING:
    from trio_gym.trainer.host_client import HostClient


@attrs.frozen
class RowError:
    code: str
    message: str


@attrs.frozen
class Row:
    """One finished example: ``result``, or ``error`` when that example failed — then
    ``record`` is its failure record (``None`` for an example refused before it ran)."""

    index: int
    result: Any = None
    error: RowError | None = None
    record: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@attrs.frozen
class StreamSummary:
    completed: int
    failed: int


class RowStream:
    """One ``POST /rollouts/run`` answered row by row; an async iterator of :class:`Row`."""

    def __init__(self, client: HostClient, examples: Sequence[Mapping[str, Any]]) -> None:
        if not examples:
            raise ValueError("an empty batch has nothing to stream; pass at least one example")
        self._client = client
        self._examples = examples
        self._exchange: ClientExchange | None = None
        self._head: h11.Response | None = None
        self._buffer = bytearray()
        self._searched = 0
        self._deadline: RequestDeadline | None = None
        self._key = new_idempotency_key()
        self._payload = b""
        self._replayed: set[int] = set()
        """Rows already read that a reattached answer sends again: skipped."""
        self.reattaches = 0
        self._finished = False
        self.seen: set[int] = set()
        self.heartbeats = 0
        self.summary: StreamSummary | None = None

    @property
    def missing(self) -> list[int]:
        """Indices of the examples that have no row (yet)."""
        return [index for index in range(len(self._examples)) if index not in self.seen]

    async def __aenter__(self) -> RowStream:
        started = False
        try:
            await self.start()
            started = True
        finally:
            if not started:
                await self.aclose()  # __aexit__ does not run when __aenter__ raises
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> RowStream:
        return self

    async def __anext__(self) -> Row:
        if self._finished:
            raise StopAsyncIteration
        row: Row | None = None
        try:
            if self._exchange is None:
                await self.start()
            row = await self._next_row()
        finally:
            if row is None:  # exhausted, failed or cancelled: the connection is done with
                await self.aclose()
        return row

    async def aclose(self) -> None:
        """Close the connection; a batch given up before its end is cancelled on the host at
        once (``DELETE`` under its key). Idempotent."""
        given_up = not self._finished and self._head is not None and self.summary is None
        self._finished = True
        exchange, self._exchange = self._exchange, None
        try:
            if exchange is not None:
                await exchange.conn.aclose()
        finally:  # a cancelled close (a cancelled consumer) still says goodbye
            if given_up:
                await self._client.give_up(self._key)

    async def start(self) -> None:
        """Send the request and wait for the answer's head (``async with`` calls it; a
        dispatcher calls it inside its gate admission, to know the host has the batch)."""
        client = self._client
        self._payload = client.encode_request(self._examples)  # too large: nothing is sent
        self._deadline = RequestDeadline(client.deadlines, client.settings.request_deadline_s)
        with self._deadline.waiting():
            try:
                await self._send()
            except NoResponse as exc:
                raise client.unanswered(exc, rows=True) from exc
            assert self._head is not None
            if self._head.status_code != 200:
                await self._refused(self._head)
            return
        waited = client.settings.request_deadline_s
        if self._head is not None:
            raise await self._cut(f"no complete refusal within {waited:g} s (request_deadline_s)")
        raise RolloutError(
            f"no response headers from {client.endpoint.authority} within {waited:g} s",
            origin=Origin.PROXY,
            reach=client.unanswered_reach(rows=True),
            suspect=True,
        )

    async def _send(self) -> None:
        """Open a connection and send the request under its key; the answer's head."""
        client = self._client
        self._exchange = await ClientExchange.open(
            client.endpoint,
            client.limits,
            opener=client.opener,
            connect_timeout_s=client.settings.connect_timeout_s,
        )
        self._head = await self._exchange.send(
            "POST",
            RUN_PATH,
            self._payload,
            headers=[
                ("content-type", JSON_MEDIA),
                ("accept", NDJSON_MEDIA),
                (IDEMPOTENCY_KEY_HEADER, self._key),
                *client.headers,
            ],
            head_timeout_s=client.head_timeout_s,
        )

    async def _reattach(self, cut: RolloutError) -> None:
        """Send the request again under its key: the host attaches it to the batch it runs
        (or kept), whose answer comes again from its start. Any failure is the chunk's, taken."""
        assert self._exchange is not None
        await self._exchange.conn.aclose()
        self.reattaches += 1
        log_event("rows_reattaching", key=self._key, seen=len(self.seen), error=cut.message)
        try:
            await self._send()
        except NoResponse as exc:
            raise RolloutError(
                f"{cut.message}; reattaching under its key got no answer: {exc}",
                origin=Origin.PROXY,
                reach=Reach.TAKEN,
                suspect=True,
            ) from exc
        assert self._head is not None
        if self._head.status_code != 200:
            try:
                await self._refused(self._head)
            except RolloutError as refusal:
                raise refusal.renamed(
                    f"{cut.message}; reattaching under its key was refused: {refusal.message}",
                    reach=Reach.TAKEN,
                ) from refusal
        self._buffer.clear()
        self._searched = 0
        self._replayed = set(self.seen)

    async def _refused(self, head: h11.Response) -> None:
        """A non-200 answer is a whole document (a refusal); classify it as ``run`` would."""
        assert self._exchange is not None
        try:
            body = await self._exchange.read_body(
                head,
                max_bytes=self._client.settings.max_response_bytes,
                idle_timeout_s=self._client.settings.idle_timeout_s,
            )
        except BodyFailed as exc:
            raise RolloutError(str(exc), origin=Origin.PROXY, reach=Reach.TAKEN) from exc
        decode_response(head.status_code, body, page_reach=self._client.unanswered_reach(rows=True))
        raise RolloutError(
            f"HTTP {head.status_code} with a results document instead of rows",
            origin=Origin.SANDBOX,
            reach=Reach.TAKEN,
            status=head.status_code,
        )

    async def _next_row(self) -> Row:
        while True:
            end = self._buffer.find(b"\n", self._searched)
            if end < 0:
                self._searched = len(self._buffer)  # search only new bytes next time
                if len(self._buffer) > self._client.settings.max_response_bytes:
                    raise self._contract(
                        f"a line longer than max_response_bytes="
                        f"{self._client.settings.max_response_bytes}"
                    )
                await self._read_more()
                continue
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            self._searched = 0
            if not line.strip():
                self.heartbeats += 1
                continue
            row = self._parse(line)
            if row is not None:
                return row

    async def _read_more(self) -> None:
        assert self._exchange is not None and self._head is not None and self._deadline
        settings = self._client.settings
        # A cut is named once out of the deadline's scope: the probe that names it is ours.
        what = f"no done line within {settings.request_deadline_s:g} s (request_deadline_s)"
        with self._deadline.waiting():
            try:
                data = await self._exchange.next_data(
                    self._head, idle_timeout_s=settings.idle_timeout_s
                )
            except BodyFailed as exc:
                what = str(exc)
            else:
                if data is not None:
                    self._buffer += data
                    return
                what = "the stream ended without its done line"
        cut = await self._cut(what)
        if cut.origin is not Origin.PROXY or self.reattaches >= settings.max_reattaches:
            raise cut
        with self._deadline.waiting():
            await self._reattach(cut)

    async def _cut(self, what: str) -> RolloutError:
        assert self._head is not None
        return await self._client.cut(
            f"{what}; {len(self.missing)} of {len(self._examples)} example(s) got no row",
            self._head.status_code,
        )

    def _parse(self, line: bytes) -> Row | None:
        """The row ``line`` holds (``None`` for one read before a reattach)."""
        try:
            document = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise self._contract(f"a line that is not JSON: {line[:200]!r}") from exc
        if not isinstance(document, dict):
            raise self._contract(f"a line that is not an object: {line[:200]!r}")
        if document.get("done") is True:
            self._end(document)
        index = document.get("index")
        if not _is_count(index) or not 0 <= index < len(self._examples):
            raise self._contract(f"a row with an index out of range: {line[:200]!r}")
        if index in self._replayed:
            self._replayed.discard(index)
            return None
        if index in self.seen:
            raise self._contract(f"a second row for example {index}")
        self.seen.add(index)
        error = document.get("error")
        if isinstance(error, dict):
            record = document.get(SIDECAR_RECORD_FIELD)
            return Row(
                index,
                error=RowError(str(error.get("code")), str(error.get("message"))),
                record=record if isinstance(record, dict) else None,
            )
        if "result" not in document:
            raise self._contract(f"a row with neither result nor error: {line[:200]!r}")
        return Row(index, result=document["result"])

    def _end(self, done: dict[str, Any]) -> None:
        self._finished = True
        error = done.get("error")
        if isinstance(error, dict):
            raise RolloutError(
                f"the host stopped the batch: {error.get('code')}: {error.get('message')} "
                f"({len(self.missing)} example(s) got no row)",
                origin=Origin.SANDBOX,
                reach=Reach.TAKEN,
                status=200,
                code=str(error.get("code")),
            )
        completed, failed = done.get("completed"), done.get("failed")
        if not _is_count(completed) or not _is_count(failed):
            raise self._contract(f"a done line without counts: {done!r}")
        if completed + failed != len(self.seen):
            raise self._contract(
                f"a done line counting {completed} + {failed} rows after {len(self.seen)} rows"
            )
        self.summary = StreamSummary(completed, failed)
        raise StopAsyncIteration

    def _contract(self, what: str) -> RolloutError:
        return RolloutError(
            f"the host's row stream broke its contract: {what}",
            origin=Origin.SANDBOX,
            reach=Reach.TAKEN,
            status=200,
        )


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
