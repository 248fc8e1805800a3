"""The ``agents`` runner: NeMo Gym's server protocol, spoken natively in trio.

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

Records are stamped as Gym's collection stamps them: ``agent_ref``, ``task_source``,
``skills_ref``, ``_ng_rollout_id`` and ``_ng_attempt_index`` from the row (when it has them),
``_ng_environment_server`` and ``_ng_result_type`` (its implementation) for the environment
server that ran it. A record carrying ``_ng_failure_class`` is Gym saying that the rollout
failed — not a result: it is run again, up to ``rollout_attempts`` tries with
``_ng_attempt_index`` counting them on the row and its record (Gym's collection retries and
stamps so), unless Gym marked it ``_ng_failure_terminal``; then the example fails, naming the
class. With the checkpoint control plane on, attempts are the trainer's: none is made here.

Addresses come from ``--agent NAME=URL`` or from a Gym head server's
``GET /global_config_dict_yaml`` (a JSON string holding the YAML of the whole deployment, each
server with its ``host`` and ``port``), read at start — waiting, with a growing backoff, for a
deployment that is not up yet — and again when a row names a server not yet known.

- Concurrency is bounded per server (``max_connections``).
- A connection that cannot be made is retried ``connect_attempts`` times with a growing
  backoff, all inside the example's deadline (Gym's own client retries refused connections
  forever). A request that reached the server is never re-sent: it may be running it.
- A non-2xx answer fails the example with the status and the start of the body, read once
  (Gym's agents answer a failure with a JSON string).
- Cancelling an example (deadline, the caller leaving, shutdown) closes its connection, which a
  Gym server treats as a cancel of the whole chain behind it.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import attrs
import trio
import yaml

from trio_gym.config import ServeConfig
from trio_gym.errors import readable_body
from trio_gym.http import (
    BodyFailed,
    ConnectFailed,
    Endpoint,
    HttpLimits,
    NoResponse,
    Response,
    StreamOpener,
    encode_json,
    exchange,
    open_tcp,
)
from trio_gym.logs import log_event
from trio_gym.runners.base import ExampleContext, report_start_progress

T = TypeVar("T")

AGENT_KEY: Final = "responses_api_agents"
ENVIRONMENT_KEY: Final = "environment_servers"
AGENT_SERVER_FIELD: Final = "agent_server"
TASKSET_ROUTES_KEY: Final = "environment_server_routes"

# Gym's record protocol (nemo-gym 0.7.0's rollout collection).
AGENT_REF_KEY: Final = "agent_ref"
ENVIRONMENT_SERVER_KEY: Final = "_ng_environment_server"
RESULT_TYPE_KEY: Final = "_ng_result_type"
FAILURE_CLASS_KEY: Final = "_ng_failure_class"
FAILURE_TERMINAL_KEY: Final = "_ng_failure_terminal"
FAILURE_MESSAGE_KEY: Final = "_ng_failure_message"
TASK_ID_KEY: Final = "_ng_task_id"
ROLLOUT_ID_KEY: Final = "_ng_rollout_id"
ATTEMPT_KEY: Final = "_ng_attempt_index"
TASK_INDEX_KEY: Final = "_ng_task_index"
ROLLOUT_INDEX_KEY: Final = "_ng_rollout_index"
# Copied from the row onto its record, as Gym's collection copies them.
ROW_KEYS_ON_RECORDS: Final = (
    AGENT_REF_KEY,
    "task_source",
    "skills_ref",
    ATTEMPT_KEY,
    ROLLOUT_ID_KEY,
)
ENVIRONMENT_SERVER_FAILED: Final = "environment_server_failed"

# Each Gym hop that fails wraps its callee's error body as a bytes literal after this phrase.
_INNER_ERROR: Final = re.compile(r"(?s)(.*?calling an inner server: )(b'.*'|b\".*\")")
# Past this, an error body is quoted as it is, not taken apart.
_UNWRAP_LIMIT: Final = 64 * 1024

# The longest single wait between looks at a deployment that is not up yet.
MAX_START_BACKOFF_S: Final = 5.0
# How long one readiness probe of a server may take.
PROBE_TIMEOUT_S: Final = 5.0


class AgentError(Exception):
    """An example could not be run by its server; the message names the server and why."""


class DeploymentNotReady(AgentError):
    """A Gym deployment is not up (yet): worth looking again until the start's timeout."""


class RolloutFailed(AgentError):
    """Gym answered that the rollout failed (``_ng_failure_class``): no result for this row."""


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
        )


@attrs.frozen
class Server:
    """One Gym server a row can be sent to."""

    name: str
    """Its instance name in the deployment (or the name given with ``--agent``)."""
    endpoint: Endpoint
    kind: str
    """``responses_api_agents`` or ``environment_servers`` (the only kinds rows go to)."""
    implementation: str = ""
    """An environment server's implementation (``legacy_agent``, ...): its ``_ng_result_type``."""

    @property
    def label(self) -> str:
        """How messages name it: ``agent 'x'`` or ``environment server 'x'``."""
        kind = "environment server" if self.kind == ENVIRONMENT_KEY else "agent"
        return f"{kind} {self.name!r}"


@attrs.frozen
class Deployment:
    """What a head server's config says: every server, who fronts which agent, taskset routes."""

    servers: Mapping[str, Server]
    """Agents and environment servers by instance name."""
    endpoints: Mapping[str, Endpoint]
    """Every server instance with an address, of any kind (what readiness probes)."""
    fronts: Mapping[str, tuple[str, ...]]
    """Agent name -> the environment servers in front of it."""
    taskset_routes: Mapping[str, str]

    @classmethod
    def parse(cls, config: Mapping[str, Any]) -> Deployment:
        """Read a merged Gym config, ``name: {server_type: {implementation: {host, port}}}``."""
        servers: dict[str, Server] = {}
        endpoints: dict[str, Endpoint] = {}
        fronts: dict[str, list[str]] = {}
        for name, instance in config.items():
            found = _server_of(str(name), instance)
            if found is None:
                continue
            server, body = found
            endpoints[server.name] = server.endpoint
            if server.kind not in (AGENT_KEY, ENVIRONMENT_KEY):
                continue
            servers[server.name] = server
            if server.kind == ENVIRONMENT_KEY:
                for agent in fronted_agents(body):
                    fronts.setdefault(agent, []).append(server.name)
        routes = config.get(TASKSET_ROUTES_KEY)
        taskset_routes = (
            {str(taskset): str(server) for taskset, server in routes.items()}
            if isinstance(routes, Mapping)
            else {}
        )
        return cls(
            servers,
            endpoints,
            {agent: tuple(names) for agent, names in fronts.items()},
            taskset_routes,
        )

    def agents(self) -> list[str]:
        """Every agent a row can name."""
        named = {name for name, server in self.servers.items() if server.kind == AGENT_KEY}
        return sorted(named | set(self.fronts))

    def server_for_agent(self, agent: str) -> Server | None:
        """Where a row naming ``agent`` goes; ``None`` if the deployment has no such agent.

        Raises :class:`AgentError` when several environment servers front it (Gym refuses such
        rows too: they must name one in ``_ng_environment_server``).
        """
        fronting = self.fronts.get(agent, ())
        if len(fronting) > 1:
            raise AgentError(
                f"agent {agent!r} is fronted by several environment servers {sorted(fronting)}; "
                f'name one in the row\'s "{ENVIRONMENT_SERVER_KEY}"'
            )
        if fronting:
            return self.servers[fronting[0]]
        server = self.servers.get(agent)
        return server if server is not None and server.kind == AGENT_KEY else None


def _server_of(name: str, instance: Any) -> tuple[Server, Mapping[str, Any]] | None:
    """The server an instance of a Gym config describes (and its config), if it has an address.

    Raises :class:`AgentError` for an address that is not one."""
    if not isinstance(instance, Mapping):
        return None
    for kind, implementations in instance.items():
        if not isinstance(implementations, Mapping):
            continue
        for implementation, body in implementations.items():
            if isinstance(body, Mapping) and "host" in body and "port" in body:
                port = body["port"]
                if isinstance(port, bool) or not isinstance(port, int | str):
                    raise AgentError(f"server {name!r} has no port but {port!r}")
                try:
                    endpoint = Endpoint(str(body["host"]), int(port), "")
                except ValueError as exc:
                    raise AgentError(f"server {name!r} has no port but {port!r}") from exc
                return Server(name, endpoint, str(kind), str(implementation)), body
    return None


def fronted_agents(server: Mapping[str, Any]) -> list[str]:
    """The agents an environment server's config puts it in front of (Gym 0.7.0's rule): every
    field whose value is typed ``responses_api_agents``, and ``agent_server`` untyped."""
    names = []
    for field, reference in server.items():
        if not isinstance(reference, Mapping):
            continue
        typed = reference.get("type")
        if typed == AGENT_KEY or (field == AGENT_SERVER_FIELD and typed is None):
            name = reference.get("name")
            if isinstance(name, str):
                names.append(name)
    return names


async def read_deployment(
    head: Endpoint, *, limits: HttpLimits, opener: StreamOpener = open_tcp
) -> Mapping[str, Any]:
    """A Gym head server's merged config (``GET /global_config_dict_yaml``: JSON-wrapped YAML).

    Bounded by ``limits.read_timeout_s`` as a whole. Raises :class:`DeploymentNotReady` when the
    head server does not answer (yet), :class:`AgentError` for an answer that cannot be used.
    """
    where = f"the head server at {head.authority}"
    with trio.move_on_after(limits.read_timeout_s) as timer:
        try:
            response = await exchange(
                head,
                "GET",
                "/global_config_dict_yaml",
                limits=limits,
                max_response_bytes=64 * 1024 * 1024,
                idle_timeout_s=limits.read_timeout_s,
                opener=opener,
            )
        except (NoResponse, BodyFailed) as exc:
            raise DeploymentNotReady(f"cannot read {where}: {exc}") from exc
    if timer.cancelled_caught:
        raise DeploymentNotReady(f"{where} did not answer within {limits.read_timeout_s:g} s")
    if response.status in (502, 503, 504):
        raise DeploymentNotReady(f"{where} answered HTTP {response.status}")
    if response.status != 200:
        raise AgentError(f"{where} answered HTTP {response.status}: {readable_body(response.body)}")
    try:
        text = json.loads(response.body)
        deployment = yaml.safe_load(text) if isinstance(text, str) else text
    except (ValueError, RecursionError, yaml.YAMLError) as exc:
        raise AgentError(f"{where} sent a config that is not JSON-wrapped YAML: {exc}") from exc
    if not isinstance(deployment, Mapping):
        raise AgentError(f"{where} sent a config that is not a mapping of servers")
    return deployment


async def _answers(endpoint: Endpoint, path: str, limits: HttpLimits, opener: StreamOpener) -> int:
    """The status ``GET path`` is answered with; raises :class:`DeploymentNotReady` if none."""
    with trio.move_on_after(PROBE_TIMEOUT_S):
        try:
            response = await exchange(
                endpoint,
                "GET",
                path,
                limits=limits,
                max_response_bytes=1024 * 1024,
                idle_timeout_s=PROBE_TIMEOUT_S,
                opener=opener,
            )
        except (NoResponse, BodyFailed) as exc:
            raise DeploymentNotReady(str(exc)) from exc
        return response.status
    raise DeploymentNotReady(f"{endpoint.authority} did not answer within {PROBE_TIMEOUT_S:g} s")


async def check_deployment(
    head: Endpoint, *, limits: HttpLimits, opener: StreamOpener, probe_servers: bool
) -> Deployment:
    """The deployment behind ``head``, if it is up: the head server's ``/health`` is 200 (a
    Gym without that route answers 404, which counts as up) and, with ``probe_servers``, every
    server it lists answers HTTP at all. Raises :class:`DeploymentNotReady` saying what is
    missing, :class:`AgentError` for a deployment that cannot be used."""
    where = f"the head server at {head.authority}"
    try:
        status = await _answers(head, "/health", limits, opener)
    except DeploymentNotReady as exc:
        raise DeploymentNotReady(f"{where} does not answer yet: {exc}") from exc
    if status not in (200, 404):
        raise DeploymentNotReady(f"{where} says the deployment is not ready (HTTP {status})")
    deployment = Deployment.parse(await read_deployment(head, limits=limits, opener=opener))
    if probe_servers:
        silent = []
        for name, endpoint in deployment.endpoints.items():
            try:
                await _answers(endpoint, "/", limits, opener)
            except DeploymentNotReady:
                silent.append(name)
        if silent:
            answering = len(deployment.endpoints) - len(silent)
            raise DeploymentNotReady(
                f"{answering} of {len(deployment.endpoints)} Gym servers answer; waiting for "
                f"{', '.join(sorted(silent))}"
            )
    return deployment


async def wait_for_deployment(
    head: Endpoint,
    *,
    limits: HttpLimits,
    opener: StreamOpener,
    timeout_s: float,
    backoff_s: float,
    probe_servers: bool,
) -> Deployment:
    """:func:`check_deployment` until it is up, looking again after a growing backoff (at most
    :data:`MAX_START_BACKOFF_S`), each reason reported to ``/health`` meanwhile. Raises
    :class:`AgentError` once ``timeout_s`` has passed, with the last reason."""
    reason = "it was never looked at"
    with trio.move_on_after(timeout_s):
        attempt = 0
        while True:
            try:
                return await check_deployment(
                    head, limits=limits, opener=opener, probe_servers=probe_servers
                )
            except DeploymentNotReady as exc:
                reason = str(exc)
            attempt += 1
            report_start_progress(reason)
            log_event("deployment_not_ready", head_server=head.authority, reason=reason)
            await trio.sleep(min(backoff_s * attempt, MAX_START_BACKOFF_S))
    raise AgentError(
        f"the Gym deployment at {head.authority} was not up within {timeout_s:g} s "
        f"(gym_start_timeout_s): {reason}"
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


def gym_error_text(body: bytes, limit: int = 1000) -> str:
    """A Gym server's error body, readable: a JSON string read once, and each inner server's
    body that Gym wrapped as a bytes literal (``calling an inner server: b'...'``) read in turn,
    so a model's error three hops down reads as itself instead of under layers of escapes."""
    text = readable_body(body[:_UNWRAP_LIMIT], limit=_UNWRAP_LIMIT)
    for _ in range(10):  # hops, at most
        wrapped = _INNER_ERROR.fullmatch(text)
        if wrapped is None:
            break
        try:
            inner = ast.literal_eval(wrapped.group(2))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            break
        if not isinstance(inner, bytes):
            break
        text = wrapped.group(1) + readable_body(inner, limit=_UNWRAP_LIMIT)
    if len(text) > limit or len(body) > _UNWRAP_LIMIT:
        return f"{text[:limit]} ... ({len(body)} bytes)"
    return text


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


def taskset_of(example: Mapping[str, Any]) -> str | None:
    """The taskset of a materialized task row (``task_id.taskset`` plus ``task_input``)."""
    task_id = example.get("task_id")
    if not isinstance(task_id, Mapping) or "task_input" not in example:
        return None
    taskset = task_id.get("taskset")
    return taskset if isinstance(taskset, str) and taskset else ""


def episode_request(row: Mapping[str, Any]) -> dict[str, Any]:
    """The body a taskset row is sent as: ``{episode_id: {rollout_id, attempt}, task}``.

    Raises ``ValueError`` for a row without an identity to name its episode by.
    """
    rollout_id = row.get(ROLLOUT_ID_KEY)
    if rollout_id is None:
        task, rollout = row.get(TASK_INDEX_KEY), row.get(ROLLOUT_INDEX_KEY)
        if task is None or rollout is None:
            raise ValueError(
                f"a taskset row needs {ROLLOUT_ID_KEY}, or {TASK_INDEX_KEY} and "
                f"{ROLLOUT_INDEX_KEY}, to name its episode"
            )
        rollout_id = f"{task}-{rollout}"
    attempt = row.get(ATTEMPT_KEY, 0)
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"{ATTEMPT_KEY} must be a non-negative integer, not {attempt!r}")
    return {
        "episode_id": {"rollout_id": rollout_id, "attempt": attempt},
        "task": {"task_id": row["task_id"], "task_input": row["task_input"]},
    }


def episode_record(response: Any) -> Any:
    """An environment server's episode answer as the record Gym's collection keeps: a
    ``failure`` becomes a failure record, a ``result`` is kept with ``_ng_task_id``. Anything
    else is returned as it came."""
    if not (
        isinstance(response, Mapping)
        and isinstance(response.get("episode_id"), Mapping)
        and ("result" in response or "failure" in response)
    ):
        return response
    task_id = response.get("task_id")
    failure = response.get("failure")
    if isinstance(failure, Mapping):
        return {
            TASK_ID_KEY: task_id,
            FAILURE_CLASS_KEY: ENVIRONMENT_SERVER_FAILED,
            FAILURE_TERMINAL_KEY: bool(failure.get("terminal", False)),
            FAILURE_MESSAGE_KEY: failure.get("failure_reason"),
        }
    result = response.get("result")
    if not isinstance(result, Mapping):
        raise AgentError(f"the episode answer for task {task_id!r} has no object result")
    return {**result, TASK_ID_KEY: task_id}


def stamp_record(row: Mapping[str, Any], record: Any, server: Server) -> Any:
    """The record with what Gym's collection copies onto every record (see the module
    docstring); a record that is not an object is left as it is."""
    if not isinstance(record, dict):
        return record
    stamped = {**record, **{key: row[key] for key in ROW_KEYS_ON_RECORDS if key in row}}
    if server.kind == ENVIRONMENT_KEY:
        stamped[ENVIRONMENT_SERVER_KEY] = server.name
        stamped[RESULT_TYPE_KEY] = server.implementation
    return stamped


class AgentsRunner:
    """Runs each example on the Gym server it names (see the module docstring)."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        limits: HttpLimits | None = None,
        opener: StreamOpener = open_tcp,
    ) -> None:
        self.settings = settings
        self.limits = limits or HttpLimits()
        self.opener = opener
        self.directory = AgentDirectory(
            settings.agents, settings.head_server, limits=self.limits, opener=opener
        )
        self._slots: dict[Endpoint, trio.CapacityLimiter] = {}

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
            backoff_s=self.settings.retry_backoff_s,
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
        episode = taskset_of(example) is not None
        first = example.get(ATTEMPT_KEY, 0) if isinstance(example.get(ATTEMPT_KEY), int) else 0
        row = dict(example)
        tries = 0
        while True:
            record = stamp_record(row, await self._call(server, row, episode=episode), server)
            failure = record.get(FAILURE_CLASS_KEY) if isinstance(record, dict) else None
            if failure is None:
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
                    f"{failure} ({how}): {record.get(FAILURE_MESSAGE_KEY) or 'no message'}"
                )
            await trio.sleep(self.settings.retry_backoff_s * tries)
            # The next try counts in _ng_attempt_index, on the row and so on its record, as
            # Gym's collection stamps it: the tries' model calls stay apart in Gym's captures.
            row = {**example, ATTEMPT_KEY: first + tries}

    async def _call(self, server: Server, row: Mapping[str, Any], *, episode: bool) -> Any:
        """POST one row (as an episode request for a taskset row); its answer, decoded."""
        body = episode_request(row) if episode else row
        response = await self._post(server, encode_json(body))
        where = f"{server.label} at {server.endpoint.authority}"
        if not 200 <= response.status < 300:
            raise AgentError(
                f"{where} answered HTTP {response.status}: {gym_error_text(response.body)}"
            )
        try:
            answer = json.loads(response.body)
        except (ValueError, RecursionError) as exc:
            quoted = readable_body(response.body)
            raise AgentError(f"{where} answered with a body that is not JSON: {quoted}") from exc
        return episode_record(answer) if episode else answer

    async def _post(self, server: Server, body: bytes) -> Response:
        """POST ``body`` to the server's ``/run`` within its concurrency bound.

        Only a connection that could not be made is tried again (waiting outside the bound);
        a request that reached the server is never sent twice: it may be running it.
        """
        endpoint = server.endpoint
        slots = self._slots.get(endpoint)
        if slots is None:
            slots = self._slots[endpoint] = trio.CapacityLimiter(self.settings.max_connections)

        async def post_once() -> Response:
            async with slots:
                return await exchange(
                    endpoint,
                    "POST",
                    "/run",
                    body,
                    limits=self.limits,
                    max_response_bytes=self.settings.max_response_bytes,
                    idle_timeout_s=self.settings.idle_timeout_s,
                    headers=[("content-type", "application/json")],
                    opener=self.opener,
                )

        try:
            return await self._attempts(post_once, server)
        except (NoResponse, BodyFailed) as exc:
            raise AgentError(f"{server.label} at {endpoint.authority}: {exc}") from exc

    async def _attempts(self, call: Callable[[], Awaitable[T]], server: Server) -> T:
        """``call()``, tried ``connect_attempts`` times while no connection can be made (a
        server not up yet), with a growing backoff slept outside any concurrency bound; the
        last failure is an :class:`AgentError` counting the attempts."""
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
            raise AgentError(f"{server.label}: {exc} (after {attempts} attempt(s))") from exc
