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
from collections.abc import Mapping
from typing import Any, Final

import attrs
import trio
import yaml

from trio_gym.config import ServeConfig
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
from trio_gym.logs import log_event
from trio_gym.runners.base import ExampleContext

AGENT_KEY: Final = "responses_api_agents"
ENVIRONMENT_KEY: Final = "environment_servers"
EXCERPT_BYTES: Final = 500


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


def servers_of(deployment: Mapping[str, Any]) -> dict[str, Endpoint]:
    """Agent name -> where to send its examples, from a Gym deployment's merged config.

    Each instance is ``name: {server_type: {implementation: {host, port, ...}}}``. An agent
    fronted by exactly one environment server is reached through it; by several, it is
    ambiguous and left out (name it with ``--agent``). Raises ``ValueError`` for a config that
    is not shaped like Gym's.
    """
    agents: dict[str, Endpoint] = {}
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
                    agents[str(name)] = endpoint
                else:
                    reference = server.get("agent_server")
                    agent = reference.get("name") if isinstance(reference, Mapping) else None
                    if agent is not None:
                        fronts.setdefault(str(agent), []).append((str(name), endpoint))
                break
    for agent, servers in fronts.items():
        if len(servers) == 1:
            agents[agent] = servers[0][1]
        else:
            agents.pop(agent, None)
            log_event("agent_ambiguous", agent=agent, servers=sorted(n for n, _ in servers))
    return agents


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
        self._refreshes = 0

    @property
    def learns(self) -> bool:
        return self._head is not None

    def known(self) -> list[str]:
        return sorted({*self._learned, *self._given})

    def lookup(self, name: str) -> Endpoint | None:
        return self._given.get(name) or self._learned.get(name)

    async def refresh(self) -> None:
        """Read the head server's config again; concurrent callers share one read.

        Raises :class:`AgentError` if the head server cannot be reached or read.
        """
        if self._head is None:
            return
        seen = self._refreshes
        async with self._refresh_lock:
            if self._refreshes != seen:  # someone else refreshed while we waited
                return
            self._learned = await self._read_head_server(self._head)
            self._refreshes += 1
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

    async def _read_head_server(self, head: Endpoint) -> dict[str, Endpoint]:
        where = f"the head server at {head.authority}"
        try:
            response = await exchange(
                head,
                "GET",
                "/global_config_dict_yaml",
                limits=self._limits,
                max_response_bytes=64 * 1024 * 1024,
                idle_timeout_s=self._limits.read_timeout_s,
                opener=self._opener,
            )
        except (NoResponse, BodyFailed) as exc:
            raise AgentError(f"cannot read {where}: {exc}") from exc
        if response.status != 200:
            raise AgentError(f"{where} answered HTTP {response.status}: {excerpt(response.body)}")
        try:
            text = json.loads(response.body)
            deployment = yaml.safe_load(text) if isinstance(text, str) else text
        except (ValueError, yaml.YAMLError) as exc:
            raise AgentError(f"{where} sent a config that is not JSON-wrapped YAML: {exc}") from exc
        if not isinstance(deployment, Mapping):
            raise AgentError(f"{where} sent a config that is not a mapping of servers")
        return servers_of(deployment)


def agent_name(example: Mapping[str, Any]) -> str:
    """The agent an example names in ``agent_ref``; ``ValueError`` (the runner protocol's
    refusal) if it names none."""
    reference = example.get("agent_ref")
    name = reference.get("name") if isinstance(reference, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError('needs "agent_ref": {"name": "<agent>"} naming the agent to run it')
    return name


def excerpt(body: bytes) -> str:
    text = body[:EXCERPT_BYTES].decode("utf-8", "replace")
    return repr(text) + (f" ... ({len(body)} bytes)" if len(body) > EXCERPT_BYTES else "")


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
        """Learn the deployment from the head server, if there is one."""
        await self.directory.refresh()

    def check_example(self, example: Mapping[str, Any]) -> None:
        name = agent_name(example)
        if not self.directory.learns and self.directory.lookup(name) is None:
            raise ValueError(
                f"unknown agent {name!r}; known agents: {self.directory.known() or 'none'}"
            )

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        name = example["agent_ref"]["name"]
        endpoint = await self.directory.resolve(name)
        slots = self._slots.get(endpoint)
        if slots is None:
            slots = self._slots[endpoint] = trio.CapacityLimiter(self.settings.max_connections)
        body = encode_json(dict(example))
        async with slots:
            response = await self._post(name, endpoint, body)
        where = f"agent {name!r} at {endpoint.authority}"
        if not 200 <= response.status < 300:
            raise AgentError(f"{where} answered HTTP {response.status}: {excerpt(response.body)}")
        try:
            return json.loads(response.body)
        except ValueError as exc:
            quoted = excerpt(response.body)
            raise AgentError(f"{where} answered with a body that is not JSON: {quoted}") from exc

    async def _post(self, name: str, endpoint: Endpoint, body: bytes) -> Any:
        attempts = self.settings.connect_attempts
        for attempt in range(1, attempts + 1):
            try:
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
            except ConnectFailed as exc:
                if attempt == attempts:
                    raise AgentError(
                        f"agent {name!r}: {exc} (after {attempts} attempt(s))"
                    ) from exc
                log_event("agent_connect_retry", agent=name, attempt=attempt, error=str(exc))
                await trio.sleep(self.settings.retry_backoff_s * attempt)
            except (NoResponse, BodyFailed) as exc:
                # It reached the agent, which may be running it: never sent twice.
                raise AgentError(f"agent {name!r} at {endpoint.authority}: {exc}") from exc
        raise AssertionError("unreachable")
