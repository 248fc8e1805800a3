"""One request to one host, and a correctly named failure: the piece every scheduler sends with.

A :class:`HostClient` sends a batch as one ``POST /rollouts/run`` — answered as a document
(:meth:`HostClient.post`) or row by row (:meth:`HostClient.stream`) — and never sends it again:
what to do after a failure is the scheduler's (:mod:`trio_gym.trainer.scheduler`). Every failure
is a :class:`RolloutError` whose ``origin`` sends the reader to the right system and whose
``reach`` says whether the host took the batch (:class:`~trio_gym.trainer.errors.Reach`: an
unreached batch may be sent again, a taken one never):

=========================================================  =========  =========
what happened                                              origin     reach
=========================================================  =========  =========
no connection                                              proxy      unreached
no response head over HTTP/1.1 (reset, timeout) (*)        proxy      unreached, once
                                                                      the host confirms
no response head for a row stream (**)                     proxy      taken
the host's "not now" (``not_ready``, ``host_busy``, ...)    sandbox    unreached
a gateway that could not reach the host (its 502/503/504)  proxy      unreached
any other non-2xx body (an HTML 502 page)                  proxy      unreached
non-2xx with the host's other ``{"error": ...}``            sandbox    refused
the request is over the host's size limit (413)            client     refused
non-2xx with a flat ``{"code", "message"}``                proxy      taken
a 2xx whose document is ``{"error": ...}``                  sandbox    taken
a body that is not UTF-8 / JSON / the expected shape       sandbox    taken
a cut answer (heartbeats only, or the body died), host     sandbox    taken
gone
a cut answer while the host's ``/health`` says ready       proxy      taken
=========================================================  =========  =========

(*) The host sends its head the moment it admits a batch; a batch sent under an
``Idempotency-Key`` (every request of this client is) runs on for its caller's return, so a
missing head is unreached only once the host says it dropped the request — a ``DELETE`` under
its key answered, or nothing listening at its address — and taken otherwise (:meth:`post`).
Over HTTP/1.0 the host answers only once the batch is done, so there only a connection that
never opened is unreached.

(**) A row stream is what a checkpoint-aware caller sends: a host that did not see its caller
leave (a proxy keeps the host's side open) may park and export the batch's episodes, so a
missing head may hide a batch the ledger must count as taken. There too only a connection that
never opened is unreached.

A cut answer is named by asking the host's ``/health`` at once (a proxy may end a cut body
cleanly, so the bytes alone cannot say whether the host died). Bugs in this process propagate
as themselves.

With ``ClientSettings(failures="records")`` a failed example does not fail its chunk: the host
answers its failure record in its place (an object with ``_ng_failure_class``, as NeMo Gym's
collection writes it; :func:`~trio_gym.protocol.rollouts.is_failure_record` tells them apart),
and ``RolloutClient.outcomes`` gives each example its result, its failure record, or the
:class:`RolloutError` of a chunk that failed as a whole — so no result is lost to another's
failure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import trio

from trio_gym.http import (
    BodyFailed,
    ConnectFailed,
    Endpoint,
    HttpLimits,
    NoResponse,
    StreamOpener,
    encode_json,
    exchange,
    open_tcp,
)
from trio_gym.http.h11_build import h11
from trio_gym.logs import log_event
from trio_gym.protocol.rollouts import (
    IDEMPOTENCY_KEY_HEADER,
    JSON_MEDIA,
    RUN_PATH,
    FailureMode,
    RolloutRequest,
    new_idempotency_key,
)
from trio_gym.trainer.answers import decode_response, is_cut, named_cut
from trio_gym.trainer.deadlines import DeadlineRegistry, RequestDeadline
from trio_gym.trainer.errors import Origin, Reach, RolloutError
from trio_gym.trainer.hosts import HostHandle
from trio_gym.trainer.stream import RowStream


@attrs.frozen
class ClientSettings:
    """How a batch is split and each request bounded; ``max_in_flight``, ``max_attempts`` and
    ``backoff_s`` are :meth:`~trio_gym.trainer.client.RolloutClient.run`'s pool of one host (its
    slots, the sends a chunk no host took may have, the pause between probes of a host that
    failed)."""

    chunk_size: int = 8
    max_in_flight: int = 8
    max_attempts: int = 3
    backoff_s: float = 1.0
    request_deadline_s: float = 1800.0 + 120.0
    """A host's own deadline (1800 s by default) should end a batch first; this bounds a host or
    proxy that keeps a request open forever."""
    host_deadline_s: float | None = None
    """Sent as the request's ``deadline_s`` when set."""
    max_request_bytes: int = 256 * 1024 * 1024
    """The host's limit (``NMP_MAX_REQUEST_BYTES``): a bigger chunk is refused before sending."""
    max_response_bytes: int = 256 * 1024 * 1024
    idle_timeout_s: float = 120.0
    """The longest gap between bytes of a response; heartbeats (15 s) keep a healthy one busy."""
    connect_timeout_s: float = 30.0
    """How long a connection may take to open."""
    head_timeout_s: float = 60.0
    """How long the response head may take once the request is sent: a host answers it as soon
    as it has read the batch (over HTTP/1.1; a 1.0 host answers at the end, so there only
    ``request_deadline_s`` bounds it). A stalled host is found in this, not in the deadline."""
    http_version: Literal["1.1", "1.0"] = "1.1"
    """``1.0`` asks for the host's buffered answer (no heartbeats), for 1.0-only proxies."""
    failures: FailureMode = "batch"
    """``records``: a failed example's failure record comes back in its place (see above)."""
    cut_probe_timeout_s: float = 5.0
    """How long the ``GET /health`` that names a cut answer may take."""
    give_up_timeout_s: float = 5.0
    """How long the ``DELETE`` that cancels a given-up request's batch at once may take."""
    max_reattaches: int = 3
    """Times a request whose answer was cut while its host lives is sent again under its
    ``Idempotency-Key`` — attached to the batch the host still runs (or has kept), never run
    twice — before it fails."""

    def __attrs_post_init__(self) -> None:
        for name in ("chunk_size", "max_in_flight", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_reattaches < 0:
            raise ValueError("max_reattaches must be at least 0")
        for name in ("request_deadline_s", "idle_timeout_s", "connect_timeout_s", "head_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


class HostClient:
    """Sends one request at a time to one host: a batch as a document (:meth:`post`) or as rows
    (:meth:`stream`), no retries. Async, trio-only; one client may serve many tasks.

    ``opener`` makes the connection (default: TCP to the URL's host and port); tests pass one
    that returns in-memory streams to an in-process host, so time can be virtual. With
    ``deadlines``, request deadlines stand still while a holder pauses them (a checkpoint
    holding admission closed: requests then wait on it, they are not slow). ``headers`` go with
    every request (a sandbox platform's proxy may route or authorise by them); ``identity`` is
    the one its provider gave the host (a stranger at a reused address refuses the request).
    """

    def __init__(
        self,
        url: str,
        settings: ClientSettings | None = None,
        *,
        limits: HttpLimits | None = None,
        opener: StreamOpener = open_tcp,
        deadlines: DeadlineRegistry | None = None,
        headers: Sequence[tuple[str, str]] = (),
        identity: str = "",
    ) -> None:
        self.endpoint = Endpoint.parse(url)
        self.host = HostHandle(self.endpoint.authority, url, tuple(headers), identity=identity)
        self.headers = self.host.request_headers()
        self.settings = settings or ClientSettings()
        self.limits = limits or HttpLimits()
        self.opener = opener
        self.deadlines = deadlines

    async def post(
        self,
        examples: Sequence[Mapping[str, Any]],
        *,
        row_offset: int = 0,
        on_heartbeat: Callable[[], None] | None = None,
    ) -> list[Any]:
        """One ``POST /rollouts/run`` for ``examples``, without retries; the results in order.
        ``row_offset`` is the position of the first in the caller's whole input (a Gym host
        numbers rows from it).

        Raises :class:`RolloutError` classified as in the module docstring.
        """
        payload = self.encode_request(examples, row_offset=row_offset)
        key = new_idempotency_key()
        try:
            return await self._post_attached(payload, key, len(examples), on_heartbeat)
        except trio.Cancelled:
            await self.give_up(key)
            raise

    async def _post_attached(
        self,
        payload: bytes,
        key: str,
        expected: int,
        on_heartbeat: Callable[[], None] | None,
    ) -> list[Any]:
        """The request under ``key``, reattached while its host lives and its answer is cut."""
        for attach in range(self.settings.max_reattaches + 1):
            try:
                return await self._post_once(payload, key, expected, on_heartbeat)
            except _Headless as headless:
                error = headless.error
                if attach:  # the host took it on the first send: a reattach never unreaches it
                    raise error.renamed(
                        f"reattaching to the answer under its key failed: {error.message}",
                        reach=Reach.TAKEN,
                    ) from headless
                if not headless.connected:
                    raise error from headless
                raise await self._unless_dropped(error, key) from headless
            except _Cut as cut:
                error = await self.cut(cut.what, cut.status)
            except RolloutError as failure:
                if attach:  # the host took it on the first send: a reattach never unreaches it
                    raise failure.renamed(
                        f"reattaching to the answer under its key failed: {failure.message}",
                        reach=Reach.TAKEN,
                    ) from failure
                raise
            if error.origin is not Origin.PROXY or attach == self.settings.max_reattaches:
                raise error.renamed(f"{error.message} (reattached {attach} time(s))")
            log_event("answer_reattaching", host=self.host.name, key=key, error=error.message)
        raise AssertionError("unreachable")

    async def _post_once(
        self,
        payload: bytes,
        key: str,
        expected: int,
        on_heartbeat: Callable[[], None] | None,
    ) -> list[Any]:
        """One exchange of the request under ``key``; :class:`_Cut` for a cut answer (named
        by the caller, out of the deadline: the probe is its own)."""
        heard = _Heard(on_heartbeat)
        started = trio.current_time()
        with RequestDeadline(self.deadlines, self.settings.request_deadline_s).waiting():
            try:
                response = await exchange(
                    self.endpoint,
                    "POST",
                    RUN_PATH,
                    payload,
                    limits=self.limits,
                    max_response_bytes=self.settings.max_response_bytes,
                    idle_timeout_s=self.settings.idle_timeout_s,
                    headers=[
                        ("content-type", JSON_MEDIA),
                        (IDEMPOTENCY_KEY_HEADER, key),
                        *self.headers,
                    ],
                    opener=self.opener,
                    request_version=self.settings.http_version.encode(),
                    on_head=heard.on_head,
                    on_data=heard.on_data,
                    connect_timeout_s=self.settings.connect_timeout_s,
                    head_timeout_s=self.head_timeout_s,
                )
            except NoResponse as exc:
                connected = not isinstance(exc, ConnectFailed)
                raise _Headless(self.unanswered(exc), connected=connected) from exc
            except BodyFailed as exc:
                if exc.too_large:
                    raise _too_large(exc) from exc
                raise _Cut(f"{exc} ({heard.heartbeats} heartbeat(s) in)", exc.status) from exc
            if not is_cut(response.status, response.body):
                return self._results(response.status, response.body, expected)
            elapsed = trio.current_time() - started
            raise _Cut(
                f"HTTP {response.status} with only heartbeat whitespace "
                f"({len(response.body)} bytes, {elapsed:.0f} s)",
                response.status,
            )
        failure = _deadline_passed(self.settings.request_deadline_s, self.endpoint, heard, self)
        if heard.status is None:
            raise _Headless(failure, connected=True)
        raise failure

    async def _unless_dropped(self, error: RolloutError, key: str) -> RolloutError:
        """A request sent with no head back: unreached only once the host says it dropped it
        (or never had it); a host that keeps a keyed batch for its caller's return would
        otherwise run it beside its re-send."""
        if await self.give_up(key):
            return error
        return error.renamed(
            f"{error.message}; the host did not confirm it dropped the request "
            f"(DELETE under its key, {self.settings.give_up_timeout_s:g} s), so it may still "
            "run it: not sent again",
            reach=Reach.TAKEN,
        )

    async def give_up(self, key: str) -> bool:
        """Tell the host the request under ``key`` is given up for good (``DELETE``): it
        cancels the batch now, not after its reattach grace. Shielded, bounded by
        ``give_up_timeout_s``; a host that does not answer cancels it after the grace.
        Whether the host is known to run nothing under ``key`` now: it answered, or nothing
        listens at its address."""
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self.settings.give_up_timeout_s
            try:
                response = await exchange(
                    self.endpoint,
                    "DELETE",
                    RUN_PATH,
                    limits=self.limits,
                    max_response_bytes=64 * 1024,
                    idle_timeout_s=self.settings.give_up_timeout_s,
                    headers=[(IDEMPOTENCY_KEY_HEADER, key), *self.headers],
                    opener=self.opener,
                    connect_timeout_s=self.settings.give_up_timeout_s,
                )
            except (NoResponse, BodyFailed) as exc:
                log_event("give_up_unanswered", host=self.host.name, key=key, error=str(exc))
                return isinstance(exc, ConnectFailed) and exc.refused
            return response.status == 200
        return False

    def _results(self, status: int, body: bytes, expected: int) -> list[Any]:
        results = decode_response(status, body, page_reach=self.unanswered_reach())
        if len(results) != expected:
            raise RolloutError(
                f"the host returned {len(results)} results for {expected} examples",
                origin=Origin.SANDBOX,
                reach=Reach.TAKEN,
                status=status,
            )
        return results

    @property
    def head_timeout_s(self) -> float:
        """The head's bound (a 1.0 host answers only at the end: none of its own there)."""
        return self.settings.head_timeout_s if self.settings.http_version == "1.1" else math.inf

    def unanswered_reach(self, failure: NoResponse | None = None, *, rows: bool = False) -> Reach:
        """Whether a chunk with no response head was taken (the module docstring's (*), and
        (**) for a row stream)."""
        if isinstance(failure, ConnectFailed):
            return Reach.UNREACHED
        return Reach.UNREACHED if self.settings.http_version == "1.1" and not rows else Reach.TAKEN

    def unanswered(self, failure: NoResponse, *, rows: bool = False) -> RolloutError:
        """The error of a request that got no response head."""
        reach = self.unanswered_reach(failure, rows=rows)
        return RolloutError(str(failure), origin=Origin.PROXY, reach=reach, suspect=True)

    async def cut(self, what: str, status: int) -> RolloutError:
        """The error of an answer cut after its head: named by the host's ``/health`` now."""
        return await named_cut(
            self.host,
            f"the answer was cut: {what}",
            status=status,
            timeout_s=self.settings.cut_probe_timeout_s,
            opener=self.opener,
            limits=self.limits,
        )

    def stream(self, examples: Sequence[Mapping[str, Any]]) -> RowStream:
        """Run ``examples`` as one request answered row by row (NDJSON), in completion order.

        See :mod:`trio_gym.trainer.stream`; no chunking or retries: the caller decides what to
        do with examples that got no row.
        """
        return RowStream(self, examples)

    def encode_request(
        self, examples: Sequence[Mapping[str, Any]], *, row_offset: int = 0
    ) -> bytes:
        """The request body for ``examples``; a :class:`RolloutError` (client) if over the limit."""
        fields: dict[str, Any] = {"examples": list(examples)}
        if self.settings.host_deadline_s is not None:
            fields["deadline_s"] = self.settings.host_deadline_s
        if self.settings.failures != "batch":
            fields["failures"] = self.settings.failures
        if row_offset:
            fields["row_offset"] = row_offset
        # Built, not validated: the examples are the caller's, checked by the host.
        payload = encode_json(RolloutRequest.model_construct(**fields).wire_fields())
        if len(payload) > self.settings.max_request_bytes:
            raise RolloutError(
                f"the request for {len(examples)} examples is {len(payload)} bytes, over the "
                f"host's limit of {self.settings.max_request_bytes}; lower the chunk size",
                origin=Origin.CLIENT,
                reach=Reach.REFUSED,
            )
        return payload


class _Headless(Exception):
    """A request that got no response head; ``connected``: it may have reached the host."""

    def __init__(self, error: RolloutError, *, connected: bool) -> None:
        super().__init__(error.message)
        self.error, self.connected = error, connected


class _Cut(Exception):
    """An answer cut after its head: what was heard, for :meth:`HostClient.cut` to name."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(what)
        self.what, self.status = what, status


class _Heard:
    """What one request has heard so far: the status (once headers arrived), heartbeats."""

    def __init__(self, on_heartbeat: Callable[[], None] | None) -> None:
        self.status: int | None = None
        self.heartbeats = 0
        self._on_heartbeat = on_heartbeat

    def on_head(self, head: h11.Response) -> None:
        self.status = head.status_code

    def on_data(self, data: bytes) -> None:
        if not data.strip():
            self.heartbeats += 1
            if self._on_heartbeat is not None:
                self._on_heartbeat()


def _too_large(failure: BodyFailed) -> RolloutError:
    return RolloutError(
        f"the response is over this client's max_response_bytes: {failure}",
        origin=Origin.CLIENT,
        reach=Reach.TAKEN,
        status=failure.status,
    )


def _deadline_passed(
    waited: float, endpoint: Endpoint, heard: _Heard, client: HostClient
) -> RolloutError:
    if heard.status is None:
        return RolloutError(
            f"no response headers from {endpoint.authority} within {waited:g} s",
            origin=Origin.PROXY,
            reach=client.unanswered_reach(),
            suspect=True,
        )
    return RolloutError(
        f"no complete answer within {waited:g} s (request_deadline_s) although the host kept "
        f"sending ({heard.heartbeats} heartbeat(s)); its own deadline should have ended the "
        "batch first: check its NMP_ROLLOUT_DEADLINE_S",
        origin=Origin.SANDBOX,
        reach=Reach.TAKEN,
        status=heard.status,
    )
