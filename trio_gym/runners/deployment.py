"""A NeMo Gym deployment as its head server describes it, and waiting until it is up.

A head server's ``GET /global_config_dict_yaml`` is a JSON string holding the YAML of the whole
merged config: each server instance ``name: {server_type: {implementation: {host, port, ...}}}``.
From it, :class:`Deployment` knows every server, which environment servers front which agents
(Gym 0.7.0's rule: any field of an environment server typed ``responses_api_agents``, and
``agent_server`` untyped) and where tasksets are routed (``environment_server_routes``).

A deployment is *up* when its head server's ``/health`` is 200 — Gym marks it so once every
server and model endpoint answers; a Gym without that route answers 404, which counts — and,
when asked, every server it lists answers HTTP at all. :func:`wait_for_deployment` looks until
then, looking every ``START_POLL_S``, saying what it waits for (``/health`` shows it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import attrs
import trio
import yaml

from trio_gym.errors import readable_body
from trio_gym.http import (
    BodyFailed,
    Endpoint,
    HttpLimits,
    NoResponse,
    StreamOpener,
    exchange,
    open_tcp,
)
from trio_gym.logs import log_event
from trio_gym.runners.base import report_start_progress

AGENT_KEY: Final = "responses_api_agents"
ENVIRONMENT_KEY: Final = "environment_servers"
AGENT_SERVER_FIELD: Final = "agent_server"
TASKSET_ROUTES_KEY: Final = "environment_server_routes"
# Between looks at a deployment that is not up yet. A look is a loopback request or two (refused,
# or a 503); every second between Gym being up and the host seeing it is a second the host is
# not ready (a growing backoff once cost up to 5 s there: NOTES.md, issue 37).
START_POLL_S: Final = 0.25
# How long one readiness probe of a server may take.
PROBE_TIMEOUT_S: Final = 5.0


class AgentError(Exception):
    """An example could not be run by its server; the message names the server and why."""


class DeploymentNotReady(AgentError):
    """A Gym deployment is not up (yet): worth looking again until the start's timeout."""


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
    config: Mapping[str, Any] = attrs.field(factory=dict)
    """The merged config itself (Gym's switches for capture are in it)."""

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
            config,
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
                'name one in the row\'s "_ng_environment_server"'
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
    probe_servers: bool,
) -> Deployment:
    """:func:`check_deployment` until it is up, every :data:`START_POLL_S`, each reason
    reported to ``/health`` meanwhile and logged when it changes. Raises :class:`AgentError`
    once ``timeout_s`` has passed, with the last reason."""
    reason = "it was never looked at"
    with trio.move_on_after(timeout_s):
        while True:
            try:
                return await check_deployment(
                    head, limits=limits, opener=opener, probe_servers=probe_servers
                )
            except DeploymentNotReady as exc:
                if str(exc) != reason:
                    log_event("deployment_not_ready", head_server=head.authority, reason=str(exc))
                reason = str(exc)
            report_start_progress(reason)
            await trio.sleep(START_POLL_S)
    raise AgentError(
        f"the Gym deployment at {head.authority} was not up within {timeout_s:g} s "
        f"(gym_start_timeout_s): {reason}"
    )
