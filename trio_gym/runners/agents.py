"""The ``agents`` runner: NeMo Gym's server protocol, spoken natively in trio.

(What a deployment is and when it is up: :mod:`.deployment`; Gym's record protocol:
:mod:`.records`.)

Each row is POSTed to a Gym server's ``/run`` and the JSON answer is its record. The row goes
where Gym 0.7.0's own rollout collection sends it:

- a row naming ``_ng_environment_server`` goes to that environment server;
- a materialized taskset row (``task_id.taskset`` plus ``task_input``) goes to the environment
  server the deployment routes its taskset to (``environment_server_routes``), as an episode
  request ``{episode_id, task}``;
- any other row names its agent in ``agent_ref: {"name": ...}`` and goes to the environment
  server in front of that agent — any field of an environment server's config typed
  ``responses_api_agents`` fronts that agent, as does ``agent_server`` — or to the agent itself
  when no environment server fronts it (``--agent NAME=URL`` names one outright).

Rows are numbered as Gym's collection numbers them (a task index from the row's position in the
caller's input), and records are stamped as it stamps them: the task and rollout indices,
``agent_ref``, ``task_source``, ``skills_ref``, ``_ng_rollout_id`` and ``_ng_attempt_index``
from the row (when it has them), ``_ng_environment_server`` and ``_ng_result_type`` (its
implementation) for the environment server that ran it. A record carrying
``_ng_failure_class`` is Gym saying that the rollout failed — not a result: it is run again, up
to ``rollout_attempts`` tries with ``_ng_attempt_index`` counting them on the row and its record
(Gym's collection retries and stamps so), unless Gym marked it ``_ng_failure_terminal``; then
the example fails with that failure record. A ``/run`` that fails fails its example at once,
with the failure record Gym's collection writes for it. With the checkpoint control plane on,
attempts are the trainer's: none is made here.

When Gym's config switches capture on (the model-call capture, token-ID capture), every record
is finished as Gym's collection finishes it, by Gym's own code (:mod:`.finalize`), and each row's
old captures are cleared before its ``/run``: with a Gym Python (``gym_python``, or this one if
it has ``nemo_gym``) and the capture folders on this machine; otherwise the host says so at
start (a warning, and ``/health``'s detail) — or, for the ``gym`` runner, fails to start.

Addresses come from ``--agent NAME=URL`` or from a Gym head server's
``GET /global_config_dict_yaml`` (a JSON string holding the YAML of the whole deployment, each
server with its ``host`` and ``port``), read at start — waiting, with a growing backoff, for a
deployment that is not up yet — and again when a row names a server not yet known.

- Concurrency is bounded per server (``max_connections``), and so are the connections kept
  alive toward it between rows (:class:`~trio_gym.http.ConnectionPool`). A cancelled
  example still closes its own connection: that is how Gym learns to cancel its model call.
- A connection that cannot be made is retried ``connect_attempts`` times with a growing
  backoff, all inside the example's deadline (Gym's own client retries refused connections
  forever). A request that reached the server is never re-sent: it may be running it.
- A non-2xx answer fails the example with the status and the start of the body, read once
  (Gym's agents answer a failure with a JSON string).
- Cancelling an example (deadline, the caller leaving, shutdown) closes its connection, which a
  Gym server treats as a cancel of the whole chain behind it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from functools import partial
from typing import Any, TypeVar

import attrs
import trio

from trio_gym.config import ServeConfig
from trio_gym.errors import readable_body
from trio_gym.http import (
    BodyFailed,
    ConnectFailed,
    ConnectionPool,
    Endpoint,
    HttpLimits,
    NoResponse,
    Response,
    StreamOpener,
    encode_json,
    open_tcp,
)
from trio_gym.logs import log_event
from trio_gym.protocol.identity import ATTEMPT_KEY, capture_key_of, numbered
from trio_gym.protocol.rollouts import FAILURE_CLASS_KEY, FAILURE_MESSAGE_KEY
from trio_gym.runners.base import ExampleContext, FinalizationCounts, report_health_note

from .deployment import (
    AGENT_KEY,
    ENVIRONMENT_KEY,
    TASKSET_ROUTES_KEY,
    AgentError,
    Deployment,
    Server,
    read_deployment,
    wait_for_deployment,
)
from .finalize import (
    FinalizationUnavailable,
    FinalizeFailed,
    RecordFinalizer,
    Retirement,
    StartWorker,
    capture_switches,
    worker_starter,
)
from .gym import GymStartFailed, gym_python
from .records import (
    AGENT_REF_KEY,
    ENVIRONMENT_SERVER_KEY,
    FAILURE_TERMINAL_KEY,
    RolloutFailed,
    RunFailed,
    episode_record,
    episode_request,
    gym_error_text,
    run_failure_record,
    stamp_record,
    taskset_of,
)

T = TypeVar("T")


@attrs.frozen
class AgentSettings:
    agents: Mapping[str, str]
    head_server: str = ""
    max_connections: int = 64
    connect_attempts: int = 5
    retry_backoff_s: float = 0.5
    rollout_attempts: int = 3
    start_timeout_s: float = 600.0
    max_response_bytes: int = 256 * 1024 * 1024
    idle_timeout_s: float = 1800.0
    """The longest a server may stay silent; the batch deadline is the real bound."""
    gym_python: str = ""
    """The Python with ``nemo_gym`` that finalizes records (default: this one, if it has it)."""
    finalize_required: bool = False
    """A start that cannot finalize records (when Gym's config captures) fails (runner gym)."""
    finalize_timeout_s: float = 60.0

    @classmethod
    def from_config(cls, config: ServeConfig, *, head_server: str | None = None) -> AgentSettings:
        return cls(
            agents=dict(config.agents),
            head_server=config.head_server if head_server is None else head_server,
            max_connections=config.agent_max_connections,
            connect_attempts=config.agent_connect_attempts,
            retry_backoff_s=config.agent_retry_backoff_s,
            # With the control plane on, an episode's attempts are the trainer's to number (its
            # ledger; the host admits them): the runner makes none of its own.
            rollout_attempts=1 if config.control_token else config.agent_rollout_attempts,
            start_timeout_s=config.gym_start_timeout_s,
            max_response_bytes=config.max_response_bytes,
            idle_timeout_s=config.rollout_deadline_s,
            gym_python=config.gym_python,
            finalize_required=config.runner == "gym",
            finalize_timeout_s=config.gym_finalize_timeout_s,
        )


class AgentDirectory:
    """Where each server is: agents given outright, or a deployment learned from a head server."""

    def __init__(
        self,
        agents: Mapping[str, str],
        head_server: str,
        *,
        limits: HttpLimits,
        opener: StreamOpener,
    ) -> None:
        self._given = {
            name: Server(name, Endpoint.parse(url), AGENT_KEY) for name, url in agents.items()
        }
        self.deployment = Deployment({}, {}, {}, {})
        self.head = Endpoint.parse(head_server) if head_server else None
        self._limits = limits
        self._opener = opener
        self._refresh_lock = trio.Lock()
        self._reads = 0
        self._last_failure: AgentError | None = None

    @property
    def learns(self) -> bool:
        return self.head is not None

    def known(self) -> list[str]:
        return sorted({*self.deployment.agents(), *self._given})

    def learn(self, deployment: Deployment) -> None:
        self.deployment = deployment
        log_event("agents_discovered", agents=self.known())

    def lookup_agent(self, name: str) -> Server | None:
        """Raises :class:`AgentError` for an agent fronted ambiguously."""
        return self._given.get(name) or self.deployment.server_for_agent(name)

    async def refresh(self) -> None:
        """Read the head server's config again; callers that wait meanwhile share its outcome.

        Raises :class:`AgentError` if the head server cannot be reached or read.
        """
        if self.head is None:
            return
        seen = self._reads
        async with self._refresh_lock:
            if self._reads != seen:  # someone else read it while we waited: share the outcome
                if self._last_failure is not None:
                    raise self._last_failure
                return
            try:
                config = await read_deployment(self.head, limits=self._limits, opener=self._opener)
            except AgentError as exc:
                self._last_failure = exc
                raise
            finally:
                self._reads += 1
            self._last_failure = None
            self.learn(Deployment.parse(config))

    async def _after_refresh(self, find: Callable[[], T | None]) -> T | None:
        found = find()
        if found is None and self.learns:
            await self.refresh()
            found = find()
        return found

    async def server_for_agent(self, name: str) -> Server:
        """The server a row naming agent ``name`` goes to; reads the head server again once if
        the name is unknown."""
        found = await self._after_refresh(lambda: self.lookup_agent(name))
        if found is None:
            raise AgentError(f"unknown agent {name!r}; known agents: {self.known() or 'none'}")
        return found

    async def environment_server(self, name: str) -> Server:
        def find() -> Server | None:
            server = self.deployment.servers.get(name)
            return server if server is not None and server.kind == ENVIRONMENT_KEY else None

        found = await self._after_refresh(find)
        if found is None:
            known = sorted(
                n for n, s in self.deployment.servers.items() if s.kind == ENVIRONMENT_KEY
            )
            raise AgentError(f"unknown environment server {name!r}; known: {known or 'none'}")
        return found

    async def taskset_server(self, taskset: str) -> Server:
        route = await self._after_refresh(lambda: self.deployment.taskset_routes.get(taskset))
        if route is None:
            raise AgentError(
                f"the deployment routes no taskset {taskset!r} ({TASKSET_ROUTES_KEY}: "
                f"{dict(self.deployment.taskset_routes) or 'none'}); name its environment "
                f'server in the row\'s "{ENVIRONMENT_SERVER_KEY}"'
            )
        return await self.environment_server(route)


def agent_name(example: Mapping[str, Any]) -> str:
    """The agent an example names in ``agent_ref``; ``ValueError`` (the runner protocol's
    refusal) if it names none."""
    reference = example.get(AGENT_REF_KEY)
    name = reference.get("name") if isinstance(reference, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError(
            'needs "agent_ref": {"name": "<agent>"} naming the agent to run it (or a taskset '
            'row\'s "task_id" and "task_input", or "_ng_environment_server")'
        )
    return name


class AgentsRunner:
    """Runs each example on the Gym server it names (see the module docstring)."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        limits: HttpLimits | None = None,
        opener: StreamOpener = open_tcp,
        finalizer_worker: StartWorker | None = None,
    ) -> None:
        """``finalizer_worker`` starts Gym's finalizer (default: the Gym Python running
        :mod:`.finalize_worker`)."""
        self.settings = settings
        self.limits = limits or HttpLimits()
        self.opener = opener
        self.directory = AgentDirectory(
            settings.agents, settings.head_server, limits=self.limits, opener=opener
        )
        self._kept: dict[Endpoint, tuple[trio.CapacityLimiter, ConnectionPool]] = {}
        """Per agent server: the bound on its connections in use, and those kept alive."""
        self.finalizer: RecordFinalizer | None = None
        """Gym's finalization of each record, when Gym's config captures and it can run here."""
        self._finalizer_worker = finalizer_worker
        self._capturing: set[str] = set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start (:meth:`start`), then, when Gym's config switches capture on, keep Gym's
        finalizer running for as long as the host serves."""
        await self.start()
        config = self.directory.deployment.config
        switches = capture_switches(config)
        if not switches:
            task_status.started()
            return
        try:
            self.finalizer = RecordFinalizer(
                config,
                self._finalizer_worker or worker_starter(self._gym_python()),
                call_timeout_s=self.settings.finalize_timeout_s,
                # An answer carries one record, which no answer of this host may exceed.
                max_line_bytes=self.settings.max_response_bytes + 1024 * 1024,
            )
            await self.finalizer.run(task_status=task_status)
        except FinalizationUnavailable as exc:
            self.finalizer = None
            why = (
                f"records are not finalized as Gym's collection finalizes them (Gym's config "
                f"switches on {', '.join(switches)}): {exc}"
            )
            if self.settings.finalize_required:
                raise GymStartFailed(why) from exc
            log_event("records_not_finalized", level=logging.WARNING, reason=why)
            report_health_note(why)
            task_status.started()

    @property
    def finalization(self) -> FinalizationCounts | None:
        return None if self.finalizer is None else self.finalizer.counts

    async def aclose(self) -> None:
        """Close the connections kept alive toward the agent servers."""
        for _, pool in self._kept.values():
            await pool.aclose()

    def _gym_python(self) -> str:
        """The Python to finalize records with; raises :class:`FinalizationUnavailable`."""
        try:
            return gym_python(self.settings.gym_python, "finalizing Gym's records")
        except GymStartFailed as exc:
            raise FinalizationUnavailable(str(exc)) from exc

    async def start(self) -> None:
        """Learn the deployment from the head server, if there is one, waiting for it to be up
        (``start_timeout_s``; ``/health`` says what it waits for meanwhile)."""
        head = self.directory.head
        if head is None:
            return
        deployment = await wait_for_deployment(
            head,
            limits=self.limits,
            opener=self.opener,
            timeout_s=self.settings.start_timeout_s,
            probe_servers=False,
        )
        self.directory.learn(deployment)

    def check_example(self, example: Mapping[str, Any]) -> None:
        named = example.get(ENVIRONMENT_SERVER_KEY)
        taskset = taskset_of(example)
        if named is not None or taskset is not None:
            if named is not None and not isinstance(named, str):
                raise ValueError(f"{ENVIRONMENT_SERVER_KEY} must be a string, not {named!r}")
            if taskset is not None:
                episode_request(example)
            if not self.directory.learns:
                raise ValueError(
                    "names an environment server (or a taskset), which this host can only find "
                    "through a Gym head server (--head-server); it knows only "
                    f"{self.directory.known()}"
                )
            return
        name = agent_name(example)
        if not self.directory.learns and self.directory.lookup_agent(name) is None:
            raise ValueError(
                f"unknown agent {name!r}; known agents: {self.directory.known() or 'none'}"
            )

    async def _server_for(self, example: Mapping[str, Any]) -> Server:
        named = example.get(ENVIRONMENT_SERVER_KEY)
        if isinstance(named, str):
            return await self.directory.environment_server(named)
        taskset = taskset_of(example)
        if taskset is not None:
            return await self.directory.taskset_server(taskset)
        return await self.directory.server_for_agent(agent_name(example))

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        server = await self._server_for(example)
        row = numbered(example, context.position)
        first = row.get(ATTEMPT_KEY, 0) if isinstance(row.get(ATTEMPT_KEY), int) else 0
        tries = 0
        while True:
            record, retirement = await self._attempt(server, row)
            failure = record.get(FAILURE_CLASS_KEY) if isinstance(record, dict) else None
            if failure is None:
                if retirement is not None and self.finalizer is not None:
                    context.when_delivered(partial(self.finalizer.retire, retirement))
                return record
            tries += 1
            terminal = bool(record.get(FAILURE_TERMINAL_KEY))
            log_event(
                "rollout_failed",
                batch=context.batch_id,
                example=context.index,
                server=server.name,
                failure_class=failure,
                tries=tries,
                terminal=terminal,
            )
            if terminal or tries == self.settings.rollout_attempts:
                how = "terminal" if terminal else f"after {tries} attempt(s)"
                raise RolloutFailed(
                    f"{server.label} reports the rollout failed: {FAILURE_CLASS_KEY}="
                    f"{failure} ({how}): {record.get(FAILURE_MESSAGE_KEY) or 'no message'}",
                    record,
                )
            await trio.sleep(self.settings.retry_backoff_s * tries)
            # The next try counts in _ng_attempt_index, on the row and so on its record, as
            # Gym's collection stamps it: the tries' model calls stay apart in Gym's captures.
            row = {**row, ATTEMPT_KEY: first + tries}

    @contextlib.contextmanager
    def _capture_key_held(self, row: Mapping[str, Any]) -> Iterator[None]:
        """While Gym's captures are finalized, one capture key (a rollout's try) runs once at a
        time here: a second would clear the first's captures and mix its own into them."""
        if self.finalizer is None:
            yield
            return
        key = capture_key_of(row)
        if key in self._capturing:
            raise AgentError(
                f"rollout {key} is already running on this host, and Gym captures its model "
                "calls by that id: give each row its own _ng_task_index/_ng_rollout_index (or "
                "_ng_rollout_id)"
            )
        self._capturing.add(key)
        try:
            yield
        finally:
            self._capturing.discard(key)

    async def _attempt(
        self, server: Server, row: Mapping[str, Any]
    ) -> tuple[Any, Retirement | None]:
        """One try of a row: its old captures cleared, its ``/run``, its record finished as Gym's
        collection finishes it. A ``/run`` that fails raises :class:`RolloutFailed` with the
        (finished) failure record Gym's collection writes for it."""
        with self._capture_key_held(row):
            gym_row = self._as_gym_holds_it(row, server)
            if self.finalizer is not None:
                await self.finalizer.prepare(gym_row)
            started = trio.current_time()
            try:
                answer = await self._call(server, row, episode=taskset_of(row) is not None)
            except RunFailed as error:
                failed = stamp_record(row, run_failure_record(error), server)
                try:
                    failed, _ = await self._finish(gym_row, failed, None)
                except FinalizeFailed as unfinished:  # the failure is the /run's, still
                    log_event(
                        "failure_record_not_finalized",
                        level=logging.WARNING,
                        reason=str(unfinished),
                    )
                raise RolloutFailed(str(error), failed) from error
            latency_ms = (trio.current_time() - started) * 1000
            return await self._finish(gym_row, stamp_record(row, answer, server), latency_ms)

    async def _finish(
        self, gym_row: Mapping[str, Any], record: Any, latency_ms: float | None
    ) -> tuple[Any, Retirement | None]:
        if self.finalizer is None:
            return record, None
        if not isinstance(record, dict):
            raise FinalizeFailed(
                f"the /run answer is {type(record).__name__}, not a record; Gym's finalization "
                "finishes records (JSON objects), as Gym's collection does"
            )
        finished = await self.finalizer.finish(gym_row, record, latency_ms)
        return finished.record, finished.retirement

    @staticmethod
    def _as_gym_holds_it(row: Mapping[str, Any], server: Server) -> Mapping[str, Any]:
        """The row as Gym's collection holds it when it finishes the record: a taskset row
        carries the environment server it was routed to."""
        if taskset_of(row) is None or ENVIRONMENT_SERVER_KEY in row:
            return row
        return {**row, ENVIRONMENT_SERVER_KEY: server.name}

    async def _call(self, server: Server, row: Mapping[str, Any], *, episode: bool) -> Any:
        """POST one row (as an episode request for a taskset row); its answer, decoded.
        Raises :class:`RunFailed` for a ``/run`` that failed."""
        body = episode_request(row) if episode else row
        response = await self._post(server, encode_json(body))
        where = f"{server.label} at {server.endpoint.authority}"
        if not 200 <= response.status < 300:
            raise RunFailed(
                f"{where} answered HTTP {response.status}: {gym_error_text(response.body)}",
                failure_type="HTTPStatusError",
                status=response.status,
                body=response.body,
            )
        try:
            answer = json.loads(response.body)
        except (ValueError, RecursionError) as exc:
            quoted = readable_body(response.body)
            raise RunFailed(
                f"{where} answered with a body that is not JSON: {quoted}",
                failure_type=type(exc).__name__,
                status=response.status,
                body=response.body,
            ) from exc
        return episode_record(answer) if episode else answer

    async def _post(self, server: Server, body: bytes) -> Response:
        """POST ``body`` to the server's ``/run`` within its concurrency bound.

        Only a connection that could not be made is tried again (waiting outside the bound);
        a request that reached the server is never sent twice: it may be running it.
        """
        endpoint = server.endpoint
        kept = self._kept.get(endpoint)
        if kept is None:
            limit = self.settings.max_connections
            kept = self._kept[endpoint] = (
                trio.CapacityLimiter(limit),
                ConnectionPool(endpoint, self.limits, max_idle=limit, opener=self.opener),
            )
        slots, pool = kept

        async def post_once() -> Response:
            async with slots:
                return await pool.exchange(
                    "POST",
                    "/run",
                    body,
                    max_response_bytes=self.settings.max_response_bytes,
                    idle_timeout_s=self.settings.idle_timeout_s,
                    headers=[("content-type", "application/json")],
                )

        try:
            return await self._attempts(post_once, server)
        except (NoResponse, BodyFailed) as exc:
            raise RunFailed(
                f"{server.label} at {endpoint.authority}: {exc}",
                failure_type=type(exc).__name__,
                status=exc.status if isinstance(exc, BodyFailed) else None,
            ) from exc

    async def _attempts(self, call: Callable[[], Awaitable[T]], server: Server) -> T:
        """``call()``, tried ``connect_attempts`` times while no connection can be made (a
        server not up yet), with a growing backoff slept outside any concurrency bound; the
        last failure is a :class:`RunFailed` counting the attempts."""
        attempts = self.settings.connect_attempts
        for attempt in range(1, attempts):
            try:
                return await call()
            except ConnectFailed as exc:
                log_event(
                    "agent_connect_retry", attempt=attempt, error=str(exc), server=server.name
                )
                await trio.sleep(self.settings.retry_backoff_s * attempt)
        try:
            return await call()
        except ConnectFailed as exc:
            raise RunFailed(
                f"{server.label}: {exc} (after {attempts} attempt(s))",
                failure_type=type(exc).__name__,
            ) from exc
