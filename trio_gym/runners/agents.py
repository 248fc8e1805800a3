"""The ``agents`` runner: NeMo Gym's agent protocol, spoken natively in trio.

Each example names its agent in ``agent_ref: {"name": ...}``. The runner POSTs the example, as
JSON and untouched, to that agent's ``/run``; the JSON answer is the result (rewards, responses
and whatever else the agent returns). Where a Gym deployment puts an *environment server* in
front of an agent (its config names the agent as ``agent_server``), the example goes to that
server instead, as Gym's own rollout collection does.

Addresses come from ``--agent NAME=URL`` or from a Gym head server's
``GET /global_config_dict_yaml`` (a JSON string holding the YAML of the whole deployment, each
server with its ``host`` and ``port``), read at start and again when an example names an agent
not yet known.

- Concurrency is bounded per agent server (``agent_max_connections``).
- A connection that cannot be made is retried ``agent_connect_attempts`` times with a growing
  backoff, all inside the example's deadline (Gym's own client retries refused connections
  forever). A request that reached the agent is never re-sent: the agent may be running it.
- A non-2xx answer fails the example with the agent's status and the start of its body.
- Cancelling an example (deadline, the caller leaving, shutdown) closes its connection, which a
  Gym server treats as a cancel of the whole chain behind it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import attrs
import trio
import yaml

from trio_gym.config import ServeConfig
from trio_gym.errors import quote_body
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
from trio_gym.runners.base import ExampleContext

T = TypeVar("T")

AGENT_KEY: Final = "responses_api_agents"
ENVIRONMENT_KEY: Final = "environment_servers"


class AgentError(Exception):
    """An example could not be run by its agent; the message names the agent and why."""


@attrs.frozen
class AgentSettings:
    agents: Mapping[str, str]
    head_server: str = ""
    max_connections: int = 64
    connect_attempts: int = 5
    retry_backoff_s: float = 0.5
    max_response_bytes: int = 256 * 1024 * 1024
    idle_timeout_s: float = 1800.0
    """The longest an agent may stay silent; the batch deadline is the real bound."""

    @classmethod
    def from_config(cls, config: ServeConfig) -> AgentSettings:
        return cls(
            agents=dict(config.agents),
            head_server=config.head_server,
            max_connections=config.agent_max_connections,
            connect_attempts=config.agent_connect_attempts,
            retry_backoff_s=config.agent_retry_backoff_s,
            max_response_bytes=config.max_response_bytes,
            idle_timeout_s=config.rollout_deadline_s,
        )


def routes_of(deployment: Mapping[str, Any]) -> dict[str, tuple[str, Endpoint]]:
    """Agent name -> (server name, endpoint) its examples go to, from a Gym deployment's config.

    Each instance is ``name: {server_type: {implementation: {host, port, ...}}}``. An agent
    fronted by exactly one environment server (whose implementation names it as
    ``agent_server``) is reached through that server; by several, it is ambiguous and left
    out (name it with ``--agent``).
    """
    agents: dict[str, tuple[str, Endpoint]] = {}
    fronts: dict[str, list[tuple[str, Endpoint]]] = {}
    for name, instance in deployment.items():
        if not isinstance(instance, Mapping):
            continue
        for server_type, implementations in instance.items():
            if server_type not in (AGENT_KEY, ENVIRONMENT_KEY) or not isinstance(
                implementations, Mapping
            ):
                continue
            for server in implementations.values():
                if not isinstance(server, Mapping) or "host" not in server or "port" not in server:
                    continue
                endpoint = Endpoint(str(server["host"]), int(server["port"]), "")
                if server_type == AGENT_KEY:
                    agents[str(name)] = (str(name), endpoint)
                else:
                    reference = server.get("agent_server")
                    agent = reference.get("name") if isinstance(reference, Mapping) else None
                    if agent is not None:
                        fronts.setdefault(str(agent), []).append((str(name), endpoint))
                break
    for agent, servers in fronts.items():
        if len(servers) == 1:
            agents[agent] = servers[0]
        else:
            agents.pop(agent, None)
            log_event("agent_ambiguous", agent=agent, servers=sorted(n for n, _ in servers))
    return agents


async def read_deployment(
    head: Endpoint, *, limits: HttpLimits, opener: StreamOpener = open_tcp
) -> Mapping[str, Any]:
    """A Gym head server's merged config (``GET /global_config_dict_yaml``: JSON-wrapped YAML).

    Bounded by ``limits.read_timeout_s`` as a whole. Raises :class:`AgentError` saying what
    went wrong.
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
            raise AgentError(f"cannot read {where}: {exc}") from exc
    if timer.cancelled_caught:
        raise AgentError(f"{where} did not answer within {limits.read_timeout_s:g} s")
    if response.status != 200:
        raise AgentError(f"{where} answered HTTP {response.status}: {quote_body(response.body)}")
    try:
        text = json.loads(response.body)
        deployment = yaml.safe_load(text) if isinstance(text, str) else text
    except (ValueError, RecursionError, yaml.YAMLError) as exc:
        raise AgentError(f"{where} sent a config that is not JSON-wrapped YAML: {exc}") from exc
    if not isinstance(deployment, Mapping):
        raise AgentError(f"{where} sent a config that is not a mapping of servers")
    return deployment


class AgentDirectory:
    """Where each agent is: given outright, or learned from a Gym head server."""

    def __init__(
        self,
        agents: Mapping[str, str],
        head_server: str,
        *,
        limits: HttpLimits,
        opener: StreamOpener,
    ) -> None:
        self._given = {name: Endpoint.parse(url) for name, url in agents.items()}
        self._learned: dict[str, Endpoint] = {}
        self._head = Endpoint.parse(head_server) if head_server else None
        self._limits = limits
        self._opener = opener
        self._refresh_lock = trio.Lock()
        self._reads = 0
        self._last_failure: AgentError | None = None

    @property
    def learns(self) -> bool:
        return self._head is not None

    def known(self) -> list[str]:
        return sorted({*self._learned, *self._given})

    def lookup(self, name: str) -> Endpoint | None:
        return self._given.get(name) or self._learned.get(name)

    async def refresh(self) -> None:
        """Read the head server's config again; callers that wait meanwhile share its outcome.

        Raises :class:`AgentError` if the head server cannot be reached or read.
        """
        if self._head is None:
            return
        seen = self._reads
        async with self._refresh_lock:
            if self._reads != seen:  # someone else read it while we waited: share the outcome
                if self._last_failure is not None:
                    raise self._last_failure
                return
            try:
                deployment = await read_deployment(
                    self._head, limits=self._limits, opener=self._opener
                )
            except AgentError as exc:
                self._last_failure = exc
                raise
            finally:
                self._reads += 1
            self._learned = {
                agent: endpoint for agent, (_, endpoint) in routes_of(deployment).items()
            }
            self._last_failure = None
            log_event("agents_discovered", head_server=self._head.authority, agents=self.known())

    async def resolve(self, name: str) -> Endpoint:
        """The endpoint for agent ``name``; refreshes once from the head server if unknown."""
        found = self.lookup(name)
        if found is None and self.learns:
            await self.refresh()
            found = self.lookup(name)
        if found is None:
            raise AgentError(f"unknown agent {name!r}; known agents: {self.known() or 'none'}")
        return found


def agent_name(example: Mapping[str, Any]) -> str:
    """The agent an example names in ``agent_ref``; ``ValueError`` (the runner protocol's
    refusal) if it names none."""
    reference = example.get("agent_ref")
    name = reference.get("name") if isinstance(reference, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError('needs "agent_ref": {"name": "<agent>"} naming the agent to run it')
    return name


class AgentsRunner:
    """Runs each example on the NeMo Gym agent it names (see the module docstring)."""

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
        """Learn the deployment from the head server, if there is one; a head server that is
        not up yet is tried ``connect_attempts`` times, with the same backoff as agents."""
        await self._attempts(self.directory.refresh, AgentError, "head_server_retry", "")

    def check_example(self, example: Mapping[str, Any]) -> None:
        name = agent_name(example)
        if not self.directory.learns and self.directory.lookup(name) is None:
            raise ValueError(
                f"unknown agent {name!r}; known agents: {self.directory.known() or 'none'}"
            )

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        name = agent_name(example)
        endpoint = await self.directory.resolve(name)
        response = await self._post(name, endpoint, encode_json(dict(example)))
        where = f"agent {name!r} at {endpoint.authority}"
        if not 200 <= response.status < 300:
            raise AgentError(
                f"{where} answered HTTP {response.status}: {quote_body(response.body)}"
            )
        try:
            return json.loads(response.body)
        except (ValueError, RecursionError) as exc:
            quoted = quote_body(response.body)
            raise AgentError(f"{where} answered with a body that is not JSON: {quoted}") from exc

    async def _post(self, name: str, endpoint: Endpoint, body: bytes) -> Response:
        """POST ``body`` to the agent's ``/run`` within its server's concurrency bound.

        Only a connection that could not be made is tried again (waiting outside the bound);
        a request that reached the agent is never sent twice: the agent may be running it.
        """
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
            return await self._attempts(
                post_once, ConnectFailed, "agent_connect_retry", f"agent {name!r}: ", agent=name
            )
        except (NoResponse, BodyFailed) as exc:
            raise AgentError(f"agent {name!r} at {endpoint.authority}: {exc}") from exc

    async def _attempts(
        self,
        call: Callable[[], Awaitable[T]],
        retried: type[Exception],
        event: str,
        prefix: str,
        **fields: Any,
    ) -> T:
        """``call()``, tried ``connect_attempts`` times while it raises ``retried`` (a server
        not up yet), with a growing backoff slept outside any concurrency bound; the last
        failure is an :class:`AgentError` counting the attempts."""
        attempts = self.settings.connect_attempts
        for attempt in range(1, attempts):
            try:
                return await call()
            except retried as exc:
                log_event(event, attempt=attempt, error=str(exc), **fields)
                await trio.sleep(self.settings.retry_backoff_s * attempt)
        try:
            return await call()
        except retried as exc:
            raise AgentError(f"{prefix}{exc} (after {attempts} attempt(s))") from exc
