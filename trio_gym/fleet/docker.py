"""Hosts as Docker containers, through the ``docker`` command (the daemon it reaches:
``DOCKER_HOST``, ``docker_host=``, or its context). On the ``host`` network the hosts are reached
at 127.0.0.1, so the daemon must be this machine's; a remote daemon needs another network, whose
published ports are reached at ``publish_address``.

Each host is one container of ``image`` (whose entrypoint starts ``trio-gym serve``, as
``scripts/gym_host.sh`` does), given the spec's environment through an env file (never on a
command line), its ``serve_args`` as the container's command, and an identity of its own.
Rules:

- **Where a host listens.** On the ``host`` network containers share the machine's: each host
  binds 127.0.0.1 at a port it chooses itself (port 0, so two never collide), and the provider
  reads it back from the host's port file (``docker cp``: nothing is needed in the image). On any
  other network the host listens on ``container_port`` in its container, published on
  ``publish_address`` at a port Docker chooses (``docker port``).
- **Ready** when ``/health`` says so and the container still runs; a container that ended, or a
  host whose ``/health`` says ``failed``, fails the launch with the end of its log.
- **Nothing is left behind.** Leaving the block removes every container launched in it (``docker
  rm -f`` after ``docker stop`` with the spec's grace), whatever ended the block. Containers carry
  their owner (machine, pid and that pid's start time) in a label; a trainer killed outright
  leaves its containers, and the next provider started on the same machine removes every one
  whose owner is no longer alive.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import tarfile
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import partial
from pathlib import Path

import attrs
import trio

from trio_gym.fleet.launch import HostSpec, Launches, Mount, new_identity, wait_ready
from trio_gym.logs import log_event
from trio_gym.trainer.hosts import HostHandle, LaunchFailed

OWNER_LABEL = "trio-gym.owner"
LAUNCH_LABEL = "trio-gym.launch"
NAME_LABEL = "trio-gym.host"
PORT_FILE = "/tmp/trio-gym-host.port"
"""Where a host on the host network writes the port it bound (``NMP_PORT_FILE``)."""


class DockerFailed(Exception):
    """A ``docker`` command failed; the message quotes what it printed."""


@attrs.define(eq=False)
class _Container:
    id: str
    scope: trio.CancelScope


class DockerProvider:
    """Launches hosts as Docker containers from ``image``; one ``hosts()`` block at a time.

    ``docker`` is the command (with its ``DOCKER_HOST`` from the environment); ``network`` is the
    containers' network (``host`` shares the machine's); ``command_timeout_s`` bounds each
    ``docker`` call.
    """

    def __init__(
        self,
        *,
        image: str,
        docker: str = "docker",
        docker_host: str | None = None,
        network: str = "host",
        publish_address: str = "127.0.0.1",
        container_port: int = 8080,
        mounts: Sequence[Mount] = (),
        poll_interval_s: float = 0.5,
        command_timeout_s: float = 60.0,
        log_tail_lines: int = 40,
    ) -> None:
        self.image = image
        self.docker = docker
        self._environment = (
            None if docker_host is None else {**os.environ, "DOCKER_HOST": docker_host}
        )
        self.network = network
        self.publish_address = publish_address
        self.container_port = container_port
        self.mounts = tuple(mounts)
        self.poll_interval_s = poll_interval_s
        self.command_timeout_s = command_timeout_s
        self.log_tail_lines = log_tail_lines
        self.launch_id = uuid.uuid4().hex
        self._running: dict[str, _Container] = {}
        self._launches = Launches("docker")
        self._spec: HostSpec | None = None

    @contextlib.asynccontextmanager
    async def hosts(self, n: int, spec: HostSpec) -> AsyncIterator[list[HostHandle]]:
        _refuse_multiline(spec.host_environment())
        try:
            await self.sweep()
        except DockerFailed as exc:
            raise LaunchFailed(f"the Docker daemon cannot be used: {exc}") from exc
        try:
            async with self._launches.block():
                self._spec = spec
                yield await self._launches.start_many(n, self._run_host)
        finally:
            with trio.CancelScope(shield=True):
                await self._remove_leftovers()

    def container_id(self, handle: HostHandle) -> str | None:
        running = self._running.get(handle.name)
        return None if running is None else running.id

    async def alive(self, handle: HostHandle) -> bool:
        """Whether the host's container still runs; ``True`` when the daemon cannot say now (a
        blip of the daemon must not eject a host: the pool's own probes decide then)."""
        running = self._running.get(handle.name)
        if running is None:
            return False
        try:
            state = await self._state(running.id)
        except DockerFailed as exc:
            log_event("container_state_unknown", host=handle.name, error=str(exc))
            return True
        return state.startswith("running")

    async def replace(self, handle: HostHandle) -> HostHandle:
        running = self._running.get(handle.name)
        if running is not None:
            running.scope.cancel()  # removed by its own task, beside the new one's start
        return await self._launches.start(self._run_host, self._launches.new_name())

    async def sweep(self) -> list[str]:
        """Remove the containers of this machine's trainers that are no longer alive (a
        trainer killed outright cannot remove its own); their ids."""
        listed = await self._docker(
            "ps", "-a", "--filter", f"label={OWNER_LABEL}",
            "--format", f'{{{{.ID}}}} {{{{.Label "{OWNER_LABEL}"}}}}',
        )  # fmt: skip
        orphans = [
            container
            for container, _, owner in (line.partition(" ") for line in listed.splitlines())
            if _is_orphaned(owner)
        ]
        if orphans:
            await self._docker("rm", "-f", *orphans)
            log_event("containers_swept", level=logging.WARNING, containers=orphans)
        return orphans

    async def _remove_leftovers(self) -> None:
        """Every container of this launch still there once each host's own removal ran (one
        whose removal failed, say): the block leaves none. Logged, never raised."""
        try:
            left = (
                await self._docker(
                    "ps", "-aq", "--filter", f"label={LAUNCH_LABEL}={self.launch_id}"
                )
            ).split()
            if left:
                await self._docker("rm", "--force", *left)
                log_event("containers_left_removed", level=logging.WARNING, containers=left)
        except DockerFailed as exc:
            log_event("container_remove_failed", level=logging.ERROR, error=str(exc))

    async def _run_host(
        self, name: str, *, task_status: trio.TaskStatus[HostHandle] = trio.TASK_STATUS_IGNORED
    ) -> None:
        assert self._spec is not None
        spec = self._spec
        identity = new_identity()
        # Shielded: a run cancelled half-way would leave a container nobody removes; each docker
        # call is bounded by command_timeout_s.
        with trio.CancelScope(shield=True):
            container = await self._create(name, spec, identity)
        try:
            with trio.CancelScope() as scope:
                self._running[name] = _Container(container, scope)
                handle = await wait_ready(
                    name,
                    locate=partial(self._locate, name, container, spec, identity),
                    ended=partial(self._ended, container),
                    log_tail=partial(self._log_tail, container),
                    timeout_s=spec.ready_timeout_s,
                    poll_interval_s=self.poll_interval_s,
                )
                task_status.started(handle)
                await trio.sleep_forever()
        finally:
            self._running.pop(name, None)
            with trio.CancelScope(shield=True):
                await self._remove(name, container, spec.stop_grace_s)

    async def _create(self, name: str, spec: HostSpec, identity: str) -> str:
        on_host_network = self.network == "host"
        listen = (
            {"NMP_RUNTIME_HTTP_HOST": "127.0.0.1", "NMP_RUNTIME_HTTP_PORT": "0",
             "NMP_PORT_FILE": PORT_FILE}
            if on_host_network
            else {"NMP_RUNTIME_HTTP_HOST": "0.0.0.0",
                  "NMP_RUNTIME_HTTP_PORT": str(self.container_port)}
        )  # fmt: skip
        environment = {**spec.host_environment(identity), **listen}
        publish = [] if on_host_network else [
            "--publish", f"{self.publish_address}::{self.container_port}"
        ]  # fmt: skip
        binds = [
            f"--mount=type=bind,source={m.source},target={m.target}"
            + (",readonly" if m.read_only else "")
            for m in self.mounts
        ]
        # The env file is read by `docker run` and removed at once: its secrets are never on a
        # command line, and never on disk longer than the call.
        with tempfile.NamedTemporaryFile("w", prefix="trio-gym-env-", suffix=".list") as file:
            os.chmod(file.name, 0o600)
            file.write("".join(f"{key}={value}\n" for key, value in environment.items()))
            file.flush()
            container_name = f"trio-gym-{self.launch_id[:12]}-{name}"
            try:
                output = await self._docker(
                    "run", "--detach", "--name", container_name,
                    "--network", self.network, *publish, *binds,
                    "--env-file", file.name,
                    "--label", f"{OWNER_LABEL}={_owner()}",
                    "--label", f"{LAUNCH_LABEL}={self.launch_id}",
                    "--label", f"{NAME_LABEL}={name}",
                    self.image, *spec.serve_args,
                )  # fmt: skip
            except DockerFailed as exc:
                # It may exist all the same (created, then failed to start; a timed-out call).
                with contextlib.suppress(DockerFailed):
                    await self._docker("rm", "--force", container_name)
                raise LaunchFailed(f"host {name}: its container did not start: {exc}") from exc
        container = output.strip().splitlines()[-1]
        log_event("container_started", host=name, container=container[:12])
        return container

    async def _locate(
        self, name: str, container: str, spec: HostSpec, identity: str
    ) -> HostHandle | None:
        if self.network == "host":
            try:
                archive = await self._docker_bytes("cp", f"{container}:{PORT_FILE}", "-")
            except DockerFailed:
                return None  # not listening yet (the file appears whole, by a rename)
            port = _read_tar_member(archive).strip()
            address = "127.0.0.1"
        else:
            try:
                mapped = await self._docker("port", container, f"{self.container_port}/tcp")
            except DockerFailed:
                return None
            address, _, port = mapped.splitlines()[0].strip().rpartition(":")
        if not port.isdigit():
            return None
        host = f"[{address.strip('[]')}]" if ":" in address else address
        return HostHandle(
            name, f"http://{host}:{port}", control_token=spec.control_token, identity=identity
        )

    async def _ended(self, container: str) -> str | None:
        try:
            state = await self._state(container)
        except DockerFailed as exc:  # the daemon cannot say now: the ready timeout bounds it
            log_event("container_state_unknown", container=container[:12], error=str(exc))
            return None
        if state.startswith(("running", "created")):
            return None
        return f"(container {container[:12]}) is {state}"

    async def _state(self, container: str) -> str:
        output = await self._docker(
            "inspect", "--format", "{{.State.Status}} (exit code {{.State.ExitCode}})", container
        )
        return output.strip()

    async def _log_tail(self, container: str) -> str:
        try:
            tail = await self._docker(
                "logs", "--tail", str(self.log_tail_lines), container, stderr_too=True
            )
        except DockerFailed as exc:
            return f"its log could not be read: {exc}"
        if not tail.strip():
            return "it printed nothing"
        return "the end of its output:\n" + tail.rstrip()

    async def _remove(self, name: str, container: str, grace_s: float) -> None:
        """Stop (SIGTERM, then SIGKILL after ``grace_s``) and remove; a failure is logged."""
        with contextlib.suppress(DockerFailed):  # already gone, or it will not stop: rm -f decides
            await self._docker("stop", "--time", str(max(0, round(grace_s))), container)
        try:
            await self._docker("rm", "--force", container)
        except DockerFailed as exc:
            log_event(
                "container_remove_failed",
                level=logging.ERROR,
                host=name,
                container=container[:12],
                error=str(exc),
            )
        else:
            log_event("container_removed", host=name, container=container[:12])

    async def _docker(self, *args: str, stderr_too: bool = False) -> str:
        return (await self._docker_bytes(*args, stderr_too=stderr_too)).decode("utf-8", "replace")

    async def _docker_bytes(self, *args: str, stderr_too: bool = False) -> bytes:
        """One ``docker`` call, bounded; its output, or :class:`DockerFailed` quoting it."""
        with trio.move_on_after(self.command_timeout_s) as bound:
            try:
                result = await trio.run_process(
                    [self.docker, *args],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                    env=self._environment,
                )
            except OSError as exc:  # no such command, not executable
                raise DockerFailed(f"cannot run {self.docker!r}: {exc}") from exc
        if bound.cancelled_caught:
            raise DockerFailed(f"docker {args[0]} did not finish in {self.command_timeout_s:g} s")
        if result.returncode != 0:
            said = result.stderr.decode("utf-8", "replace").strip()[-2000:]
            raise DockerFailed(f"docker {args[0]} exited {result.returncode}: {said}")
        return result.stdout + (result.stderr if stderr_too else b"")


def _refuse_multiline(environment: Mapping[str, str]) -> None:
    bad = sorted(key for key, value in environment.items() if "\n" in value or "\n" in key)
    if bad:
        raise ValueError(
            f"the hosts' environment cannot carry a line break (in {', '.join(bad)}): Docker's "
            "env file is one variable per line"
        )


def _read_tar_member(archive: bytes) -> str:
    """The first file of the tar stream ``docker cp ... -`` writes."""
    try:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for member in tar:
                extracted = tar.extractfile(member)
                if extracted is not None:
                    return extracted.read().decode("utf-8", "replace")
    except tarfile.TarError:
        pass
    return ""


def _machine() -> str:
    """This machine and pid namespace: pids mean something only within one."""
    machine = socket.gethostname()
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            if found := Path(path).read_text().strip():
                machine = found
                break
    with contextlib.suppress(OSError):
        machine += ":" + os.readlink("/proc/self/ns/pid").strip("pid:[]")
    return machine


def _started(pid: int) -> str | None:
    """The start time (in clock ticks since boot) of process ``pid``, ``None`` if it is gone: a
    pid alone may have been reused since."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _owner() -> str:
    return f"{_machine()}/{os.getpid()}/{_started(os.getpid())}"


def _is_orphaned(owner: str) -> bool:
    """Whether ``owner`` (an :data:`OWNER_LABEL`) is a trainer of this machine that is gone."""
    machine, _, rest = owner.partition("/")
    pid, _, started = rest.partition("/")
    if machine != _machine() or not pid.isdigit() or not started.isdigit():
        return False  # another machine's or namespace's, or no start time to judge by
    return _started(int(pid)) != started


__all__ = ["DockerFailed", "DockerProvider", "OWNER_LABEL"]
