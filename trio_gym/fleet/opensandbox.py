"""Hosts in OpenSandbox sandboxes, through the ``opensandbox`` SDK (``trio_gym[opensandbox]``).

The SDK's async client is asyncio-only; its sync client is called from trio worker threads.
Each host is one sandbox whose entrypoint is ``scripts/gym_host.sh`` in the image, started with
the spec's environment, ``NMP_RUNTIME_HTTP_PORT`` and an identity of its own; its URL is the
endpoint the server publishes for that port, and every request carries the endpoint's headers
and, through the server's proxy, the API key (a multi-tenant server checks it there). Rules:

- **Where a host listens.** Sandboxes on the host network (OpenSandbox's docker runtime's
  default) share the machine's: each host gets its own port of ``ports`` and binds 127.0.0.1
  (the proxy reaches it there; nothing else on the machine's interfaces does). A port that
  something else holds is skipped for the next. Sandboxes with networks of their own all use
  ``port`` and listen on every interface of theirs.
- **A failed host says why.** Before a sandbox that failed to start is deleted (and its log with
  it), its log is read through the server's diagnostics API and quoted in ``LaunchFailed``.

- **Credentials never reach the host.** The API key goes to the SDK's connection, never into a
  sandbox's environment, and a spec whose environment carries ``OPEN_SANDBOX_*``,
  ``OPENSANDBOX_*`` or ``RAY_ADDRESS`` is refused before anything is created (the sandbox's
  code can read its own environment).
- **A create whose answer was lost is rolled back.** Every create carries a launch id of its own
  in the sandbox's metadata; a create that fails is followed by listing sandboxes with that id and
  killing each, and one that succeeds kills any other sandbox with its id (a create the transport
  sent twice). The create is tried ``create_attempts`` times, a fresh id each.
- **The TTL is renewed at half its length** while the block runs: a trainer that dies leaves
  sandboxes that end by themselves within one TTL.
- Leaving the block kills every sandbox launched in it (a shielded kill each, bounded by the
  SDK's request timeout).
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_gym.errors import raise_unwrapped
from trio_gym.fleet.launch import HostSpec, Launches, Mount, new_identity, wait_ready
from trio_gym.logs import log_event
from trio_gym.trainer.hosts import HostHandle, LaunchFailed

if TYPE_CHECKING:
    from opensandbox.sync import SandboxSync

LAUNCH_KEY = "trio-gym-launch"
"""The metadata key every sandbox is created with: its create attempt's id."""
NAME_KEY = "trio-gym-host"
ALIVE_STATES = frozenset({"Pending", "Running"})
API_KEY_HEADER = "OPEN-SANDBOX-API-KEY"
_ADDRESS_IN_USE = "Address already in use"
_LOG_TAIL_LINES = 40
_PORT_TRIES = 3
"""Ports a host tries before its launch fails: a port held by something else is skipped, but
"Address already in use" in a log may be another process's (a Gym server's)."""

_CREDENTIAL_VARIABLE = re.compile(r"^(OPEN_?SANDBOX_.*|RAY_ADDRESS)$")


def refuse_credentials(environment: Mapping[str, str]) -> None:
    """Raise ``ValueError`` naming any variable that would hand the host a platform credential."""
    found = sorted(name for name in environment if _CREDENTIAL_VARIABLE.match(name))
    if found:
        raise ValueError(
            f"the hosts' environment must not carry {', '.join(found)}: a sandbox's code can "
            "read its environment; give the provider its credentials instead (api_key=, domain=)"
        )


@attrs.define(eq=False)
class _Sandbox:
    sandbox: SandboxSync
    scope: trio.CancelScope


class OpenSandboxProvider:
    """Launches hosts as OpenSandbox sandboxes; one ``hosts()`` block at a time.

    ``entrypoint`` runs the host inside the image (``gym_host.sh`` and the runtime that has
    trio_gym); ``mounts`` are host-path volumes of every sandbox (the server's
    ``[storage] allowed_host_paths`` must admit them); ``host_network`` says the sandboxes
    share the machine's network (then each host listens on its own port of ``ports``;
    otherwise on ``port``); ``domain`` and ``api_key`` default to the SDK's own
    (``OPEN_SANDBOX_DOMAIN``, ``OPEN_SANDBOX_API_KEY``).
    """

    def __init__(
        self,
        *,
        image: str,
        entrypoint: Sequence[str],
        domain: str | None = None,
        api_key: str | None = None,
        host_network: bool = True,
        ports: Sequence[int] = range(18080, 18180),
        port: int = 8080,
        ttl_s: float = 14400.0,
        resource: Mapping[str, str] | None = None,
        mounts: Sequence[Mount] = (),
        use_server_proxy: bool = True,
        create_attempts: int = 2,
        poll_interval_s: float = 1.0,
        request_timeout_s: float = 30.0,
    ) -> None:
        try:
            from opensandbox.config import ConnectionConfigSync  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "the OpenSandbox provider needs the opensandbox SDK: "
                "pip install 'trio-gym[opensandbox]'"
            ) from exc
        if ttl_s <= 0 or create_attempts < 1:
            raise ValueError("ttl_s must be positive and create_attempts at least 1")
        if host_network and not ports:
            raise ValueError("sandboxes on the host network need ports to listen on")
        self.image = image
        self.entrypoint = list(entrypoint)
        self.domain = domain
        self._api_key = api_key
        self.host_network = host_network
        self.ports = tuple(ports)
        self.port = port
        self.ttl_s = ttl_s
        self.resource = dict(resource) if resource else None
        self.mounts = tuple(mounts)
        self.use_server_proxy = use_server_proxy
        self.create_attempts = create_attempts
        self.poll_interval_s = poll_interval_s
        self.request_timeout_s = request_timeout_s
        self._running: dict[str, _Sandbox] = {}
        self._ports_held: set[int] = set()
        self._launches = Launches("sandbox")
        self._spec: HostSpec | None = None

    @contextlib.asynccontextmanager
    async def hosts(self, n: int, spec: HostSpec) -> AsyncIterator[list[HostHandle]]:
        refuse_credentials(spec.host_environment())
        async with self._launches.block():
            self._spec = spec
            yield await self._launches.start_many(n, self._run_host)

    def sandbox_id(self, handle: HostHandle) -> str | None:
        running = self._running.get(handle.name)
        return None if running is None else running.sandbox.id

    async def alive(self, handle: HostHandle) -> bool:
        """Whether the sandbox still runs; ``True`` when the server cannot say now (a blip of
        its API must not eject a host: the pool's own probes decide then)."""
        from opensandbox.exceptions import SandboxException

        running = self._running.get(handle.name)
        if running is None:
            return False
        try:
            return await trio.to_thread.run_sync(_state, running.sandbox) in ALIVE_STATES
        except SandboxException as exc:
            log_event("sandbox_state_unknown", host=handle.name, error=str(exc))
            return True

    async def replace(self, handle: HostHandle) -> HostHandle:
        running = self._running.get(handle.name)
        if running is not None:
            running.scope.cancel()
        return await self._launches.start(self._run_host, self._launches.new_name())

    async def _run_host(
        self, name: str, *, task_status: trio.TaskStatus[HostHandle] = trio.TASK_STATUS_IGNORED
    ) -> None:
        assert self._spec is not None
        if not self.host_network:
            return await self._run_sandbox(name, self._spec, self.port, task_status)
        last: LaunchFailed | None = None
        tried: list[int] = []
        while len(tried) < _PORT_TRIES and (port := self._free_port(tried)) is not None:
            tried.append(port)
            self._ports_held.add(port)
            try:
                return await self._run_sandbox(name, self._spec, port, task_status)
            except LaunchFailed as exc:
                if _ADDRESS_IN_USE not in str(exc):
                    raise
                last = exc
                log_event("sandbox_port_in_use", level=logging.WARNING, host=name, port=port)
            finally:
                self._ports_held.discard(port)
        if last is None:
            raise LaunchFailed(
                f"host {name}: this provider's hosts hold every port of ports= "
                f"({self.ports[0]}..{self.ports[-1]}); give it more"
            )
        raise LaunchFailed(
            f"host {name}: ports {tried} are held by something else on the sandboxes' shared "
            f"network; the last try: {last}"
        )

    def _free_port(self, tried: list[int]) -> int | None:
        """The first port of ``ports`` no host of this provider holds and ``tried`` lacks."""
        return next((p for p in self.ports if p not in self._ports_held and p not in tried), None)

    async def _run_sandbox(
        self, name: str, spec: HostSpec, port: int, task_status: trio.TaskStatus[HostHandle]
    ) -> None:
        identity = new_identity()
        # Shielded: a create cancelled half-way would leave a sandbox nobody kills. The SDK's own
        # request and readiness timeouts bound it.
        with trio.CancelScope(shield=True):
            sandbox = await trio.to_thread.run_sync(self._create, name, spec, port, identity)
        try:
            with trio.CancelScope() as scope:
                self._running[name] = _Sandbox(sandbox, scope)
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._renew_at_half_ttl, name, sandbox)
                        handle = await wait_ready(
                            name,
                            locate=partial(self._locate, name, sandbox, spec, port, identity),
                            ended=partial(_ended, sandbox),
                            log_tail=partial(_log_tail, sandbox),
                            timeout_s=spec.ready_timeout_s,
                            poll_interval_s=self.poll_interval_s,
                        )
                        task_status.started(handle)
                except ExceptionGroup as group:  # a failed start as itself: a port may be retried
                    raise_unwrapped(group, alike=LaunchFailed)
        finally:
            self._running.pop(name, None)
            # Shielded so a cancelled block still kills it; bounded by the SDK's request timeout.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_kill, name, sandbox)

    def _connection(self) -> Any:
        from opensandbox.config import ConnectionConfigSync

        return ConnectionConfigSync(
            domain=self.domain,
            api_key=self._api_key,
            use_server_proxy=self.use_server_proxy,
            request_timeout=timedelta(seconds=self.request_timeout_s),
        )

    def _create(self, name: str, spec: HostSpec, port: int, identity: str) -> SandboxSync:
        """Create ``name``'s sandbox (in a worker thread), rolling back every failed attempt."""
        from opensandbox.exceptions import SandboxException
        from opensandbox.models.sandboxes import Host, Volume
        from opensandbox.sync import SandboxSync

        volumes = [
            Volume(
                name=f"mount-{index}",
                host=Host(path=mount.source),
                mountPath=mount.target,
                readOnly=mount.read_only,
            )
            for index, mount in enumerate(self.mounts)
        ]
        listen = {"NMP_RUNTIME_HTTP_HOST": "127.0.0.1"} if self.host_network else {}
        environment = {
            **spec.host_environment(identity),
            **listen,
            "NMP_RUNTIME_HTTP_PORT": str(port),
        }
        failures: list[str] = []
        for _ in range(self.create_attempts):
            launch_id = uuid.uuid4().hex
            try:
                sandbox = SandboxSync.create(
                    self.image,
                    entrypoint=self.entrypoint,
                    env=environment,
                    metadata={NAME_KEY: name, LAUNCH_KEY: launch_id},
                    timeout=timedelta(seconds=self.ttl_s),
                    ready_timeout=timedelta(seconds=spec.ready_timeout_s),
                    resource=self.resource,
                    volumes=volumes or None,
                    connection_config=self._connection(),
                    skip_health_check=True,
                )
            except SandboxException as exc:
                rolled_back = self._kill_launched(launch_id, keep=None)
                failures.append(f"{type(exc).__name__}: {exc} (rolled back: {rolled_back})")
                log_event(
                    "sandbox_create_failed", level=logging.WARNING, host=name, error=failures[-1]
                )
                continue
            self._kill_launched(launch_id, keep=sandbox.id)
            log_event("sandbox_created", host=name, sandbox=sandbox.id)
            return sandbox
        raise LaunchFailed(
            f"host {name}: creating its sandbox failed {len(failures)} time(s): "
            + "; ".join(failures)
        )

    def _kill_launched(self, launch_id: str, *, keep: str | None) -> list[str]:
        """Kill every sandbox created under ``launch_id`` but ``keep``; their ids."""
        from opensandbox.models.sandboxes import SandboxFilter
        from opensandbox.sync import SandboxManagerSync

        manager = SandboxManagerSync.create(self._connection())
        try:
            found = manager.list_sandbox_infos(SandboxFilter(metadata={LAUNCH_KEY: launch_id}))
            killed = []
            for info in found.sandbox_infos:
                if info.id != keep and info.status.state in ALIVE_STATES:
                    manager.kill_sandbox(info.id)
                    killed.append(info.id)
            return killed
        finally:
            manager.close()

    async def _locate(
        self, name: str, sandbox: SandboxSync, spec: HostSpec, port: int, identity: str
    ) -> HostHandle | None:
        from opensandbox.exceptions import SandboxException

        try:
            endpoint = await trio.to_thread.run_sync(sandbox.get_endpoint, port)
        except SandboxException as exc:  # asked again at the next poll
            log_event("sandbox_endpoint_unknown", host=name, error=str(exc))
            return None
        address = endpoint.endpoint
        url = address if "://" in address else f"http://{address}"
        if not url.startswith("http://"):
            raise LaunchFailed(
                f"host {name}: the sandbox's port {port} is published as {address!r}; "
                "trio_gym's client speaks plain http:// only (try use_server_proxy=False)"
            )
        headers = dict(endpoint.headers)
        if self.use_server_proxy:  # the endpoint API names none in proxy mode; a server may check
            headers.setdefault(API_KEY_HEADER, self._connection().get_api_key())
        return HostHandle(
            name,
            url,
            tuple(sorted(headers.items())),
            control_token=spec.control_token,
            identity=identity,
        )

    async def _renew_at_half_ttl(self, name: str, sandbox: SandboxSync) -> None:
        from opensandbox.exceptions import SandboxException

        ttl = timedelta(seconds=self.ttl_s)
        while True:
            await trio.sleep(self.ttl_s / 2)
            try:
                await trio.to_thread.run_sync(sandbox.renew, ttl)
                log_event("sandbox_renewed", host=name, sandbox=sandbox.id)
            except SandboxException as exc:  # retried at the next half; the TTL is the backstop
                log_event("sandbox_renew_failed", level=logging.WARNING, host=name, error=str(exc))


def _state(sandbox: SandboxSync) -> str:
    return str(sandbox.get_info().status.state)


async def _ended(sandbox: SandboxSync) -> str | None:
    from opensandbox.exceptions import SandboxException

    try:
        info = await trio.to_thread.run_sync(sandbox.get_info)
    except SandboxException as exc:  # the server cannot say now: the ready timeout bounds it
        log_event("sandbox_state_unknown", sandbox=sandbox.id, error=str(exc))
        return None
    if info.status.state in ALIVE_STATES:
        return None
    why = ": ".join(part for part in (info.status.reason, info.status.message) if part)
    return f"(sandbox {sandbox.id}) is {info.status.state}" + (f" ({why})" if why else "")


async def _log_tail(sandbox: SandboxSync) -> str:
    """The end of the sandbox's log, read through the server before the sandbox is deleted."""
    from opensandbox.exceptions import SandboxException

    try:
        logs = await trio.to_thread.run_sync(sandbox.get_diagnostic_logs, "container")
    except SandboxException as exc:
        return f"its log (sandbox {sandbox.id}) could not be read: {exc}"
    lines = (logs.content or "").rstrip().splitlines()[-_LOG_TAIL_LINES:]
    if not lines:
        return f"it printed nothing (sandbox {sandbox.id})"
    return f"the end of its output (sandbox {sandbox.id}):\n" + "\n".join(lines)


def _kill(name: str, sandbox: SandboxSync) -> None:
    from opensandbox.exceptions import SandboxException

    try:
        sandbox.kill()
    except SandboxException as exc:  # logged; its TTL ends it
        log_event(
            "sandbox_kill_failed",
            level=logging.ERROR,
            host=name,
            sandbox=sandbox.id,
            error=str(exc),
        )
    else:
        log_event("sandbox_killed", host=name, sandbox=sandbox.id)
    finally:
        sandbox.close()
