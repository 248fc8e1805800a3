"""Hosts placed on a Ray cluster's nodes (``trio_gym[ray]``): one small actor per host owns it.

``RayProvider().hosts(n, spec)`` reserves a placement group of ``n`` bundles with strategy
``SPREAD`` (one host per node while there are nodes), starts a :class:`HostOwner` actor in each
bundle, and each owner starts ``trio-gym serve`` on its node, bound to the node's address, on a
port of the host's choosing (read back from ``--port-file``): the URL it hands back is reachable
from the trainer as far as the cluster's nodes reach each other. The host runs under the guard
(:mod:`trio_gym.processes.guard`) with the owner holding its lifeline, so an owner that dies — a
``ray.kill``, a lost node's worker — takes its host with it; its output goes to a file beside it,
never an undrained pipe. Leaving the block stops every host (SIGTERM, SIGKILL after the grace),
kills the owners and removes the placement group. The trainer must have called ``ray.init``.
Ray's calls block, so they run in trio worker threads.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from trio_gym.fleet.launch import HostSpec, Launches, new_identity, wait_ready
from trio_gym.processes.output import TAIL_LINES
from trio_gym.processes.tree import GUARD, GUARD_MARGIN_S
from trio_gym.trainer.hosts import HostHandle, LaunchFailed

PORT_WAIT_S: Final = 120.0
"""How long an owner waits for its host to say where it listens."""
OWNER_ANSWER_S: Final = 30.0
"""How long a question to a running owner actor may take."""


class HostOwner:
    """A Ray actor (made remote by the provider) that owns one host process on its node."""

    def __init__(self) -> None:
        self._guard: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    def start(
        self, name: str, argv: Sequence[str], environment: Mapping[str, str], grace_s: float
    ) -> str:
        """Start the host under the guard and return its URL once it listens."""
        import ray

        # The address the cluster knows this node by: its nodes reach each other there.
        node = ray.get_runtime_context().get_node_id()
        nodes = ray.nodes()  # type: ignore[no-untyped-call]
        address: str = next(n["NodeManagerAddress"] for n in nodes if n["NodeID"] == node)
        directory = Path(tempfile.mkdtemp(prefix=f"trio-gym-{name}-"))
        port_file, self._log = directory / "port", directory / "output.log"
        command = [
            *(sys.executable, "-I", str(GUARD), "--grace", repr(grace_s), "--"),
            *argv,
            *("--host", address, "--port", "0", "--port-file", str(port_file)),
        ]
        with self._log.open("ab") as log:
            self._guard = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,  # the lifeline: it closes when this actor's process ends
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **environment},
                start_new_session=True,
            )
        deadline = time.monotonic() + PORT_WAIT_S  # clock-ok: a blocking actor method, not trio
        while not port_file.exists():
            if self._guard.poll() is not None or time.monotonic() > deadline:  # clock-ok
                return ""  # the provider sees the end (or the silence) and reads the log
            time.sleep(0.05)  # clock-ok: as above
        return f"http://{address}:{int(port_file.read_text())}"

    def ended(self) -> str | None:
        """How the host ended, or ``None`` while it runs."""
        if self._guard is None or self._guard.poll() is None:
            return None
        return f"exited with status {self._guard.returncode}"

    def output_tail(self) -> str:
        if self._log is None or not self._log.exists():
            return "it printed nothing"
        lines = deque(self._log.read_text(errors="replace").splitlines(), maxlen=TAIL_LINES)
        return "the end of its output:\n" + "\n".join(lines) if lines else "it printed nothing"

    def stop(self, grace_s: float) -> None:
        """Close the lifeline: the guard stops the host (SIGKILL after the grace)."""
        if self._guard is None or self._guard.poll() is not None:
            return
        assert self._guard.stdin is not None
        self._guard.stdin.close()
        try:
            self._guard.wait(timeout=grace_s + GUARD_MARGIN_S)
        except subprocess.TimeoutExpired:
            self._guard.kill()
            self._guard.wait()


@attrs.define(eq=False)
class _Owned:
    owner: Any
    bundle: int
    scope: trio.CancelScope


class RayProvider:
    """Launches hosts on a Ray cluster's nodes; one ``hosts()`` block at a time.

    ``cpus_per_host`` is what each bundle (and owner) reserves in Ray's accounting;
    ``python`` runs ``-m trio_gym serve`` on the nodes (default: this interpreter's path, which
    a cluster built from one image shares).
    """

    def __init__(
        self,
        *,
        cpus_per_host: float = 1.0,
        python: str = sys.executable,
        poll_interval_s: float = 0.2,
        placement_timeout_s: float = 300.0,
    ) -> None:
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            raise ImportError("the Ray provider needs Ray: pip install 'trio-gym[ray]'") from exc
        self.cpus_per_host = cpus_per_host
        self.python = python
        self.poll_interval_s = poll_interval_s
        self.placement_timeout_s = placement_timeout_s
        self._owned: dict[str, _Owned] = {}
        self._launches = Launches("ray")
        self._launch: tuple[HostSpec, Any] | None = None

    @contextlib.asynccontextmanager
    async def hosts(self, n: int, spec: HostSpec) -> AsyncIterator[list[HostHandle]]:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if n < 1:
            raise ValueError("launch at least one host")
        if not ray.is_initialized():
            raise RuntimeError("the Ray provider places hosts on a cluster: call ray.init first")
        group = await trio.to_thread.run_sync(
            partial(placement_group, [{"CPU": self.cpus_per_host}] * n, strategy="SPREAD")
        )
        try:
            try:
                await trio.to_thread.run_sync(
                    partial(ray.get, group.ready(), timeout=self.placement_timeout_s)
                )
            except ray.exceptions.GetTimeoutError as exc:
                raise LaunchFailed(
                    f"Ray could not place {n} bundles of {self.cpus_per_host} CPU within "
                    f"{self.placement_timeout_s:g} s; lower cpus_per_host or add nodes"
                ) from exc
            async with self._launches.block():
                self._launch = (spec, group)
                yield await self._launches.start_many(n, self._run_host, lambda bundle: (bundle,))
        finally:
            with trio.CancelScope(shield=True):  # one call to Ray's control store, answered fast
                await trio.to_thread.run_sync(remove_placement_group, group)

    async def alive(self, handle: HostHandle) -> bool:
        owned = self._owned.get(handle.name)
        return owned is not None and await _ended(owned.owner) is None

    async def replace(self, handle: HostHandle) -> HostHandle:
        owned = self._owned.get(handle.name)
        if owned is None:
            raise LaunchFailed(f"host {handle.name} was not launched by this provider")
        owned.scope.cancel()  # its task stops it and frees its bundle for the new one
        return await self._launches.start(self._run_host, self._launches.new_name(), owned.bundle)

    async def _run_host(
        self,
        name: str,
        bundle: int,
        *,
        task_status: trio.TaskStatus[HostHandle] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self._launch is not None
        spec, group = self._launch
        owner: Any = (
            ray.remote(HostOwner)
            .options(
                num_cpus=self.cpus_per_host,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle
                ),
            )
            .remote()
        )
        argv = [self.python, "-m", "trio_gym", "serve", *spec.serve_args]
        identity = new_identity()
        try:
            with trio.CancelScope() as scope:
                self._owned[name] = _Owned(owner, bundle, scope)
                environment = spec.host_environment(identity)
                started = owner.start.remote(name, argv, environment, spec.stop_grace_s)
                url = await _started_at(name, started, PORT_WAIT_S + spec.ready_timeout_s)
                handle = (
                    HostHandle(name, url, control_token=spec.control_token, identity=identity)
                    if url
                    else None
                )
                task_status.started(
                    await wait_ready(
                        name,
                        locate=partial(_constant, handle),
                        ended=partial(_ended, owner),
                        log_tail=partial(_output_tail, owner),
                        timeout_s=spec.ready_timeout_s,
                        poll_interval_s=self.poll_interval_s,
                    )
                )
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_stop_owner, owner, spec.stop_grace_s)


async def _started_at(name: str, started: Any, timeout_s: float) -> str:
    """The URL its owner started the host at ("" if it ended first), or :class:`LaunchFailed`
    when the owner could not be placed or died (a wait cancellation could not interrupt)."""
    import ray

    try:
        url: str = await trio.to_thread.run_sync(_ray_get, started, timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise LaunchFailed(
            f"host {name}: its owner actor did not start it within {timeout_s:g} s (is there "
            "room on the cluster for its bundle?)"
        ) from exc
    except ray.exceptions.RayActorError as exc:
        raise LaunchFailed(f"host {name}: its owner actor died while starting it: {exc}") from exc
    return url


async def _constant(handle: HostHandle | None) -> HostHandle | None:
    return handle


async def _ended(owner: Any) -> str | None:
    """How the host ended; ``None`` while it runs, or while its owner does not answer (the
    caller's own health probes then decide)."""
    import ray

    try:
        ended: str | None = await trio.to_thread.run_sync(
            _ray_get, owner.ended.remote(), OWNER_ANSWER_S
        )
    except ray.exceptions.RayActorError as exc:
        return f"lost its owner actor ({type(exc).__name__})"
    except ray.exceptions.GetTimeoutError:
        return None
    return ended


async def _output_tail(owner: Any) -> str:
    import ray

    try:
        tail: str = await trio.to_thread.run_sync(ray.get, owner.output_tail.remote())
    except ray.exceptions.RayActorError:
        return "its owner actor is gone, and its output with it"
    return tail


def _ray_get(ref: Any, timeout_s: float) -> Any:
    import ray

    return ray.get(ref, timeout=timeout_s)


def _stop_owner(owner: Any, grace_s: float) -> None:
    """Stop the host (bounded by the grace and a margin), then the owner."""
    import ray

    with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        ray.get(owner.stop.remote(grace_s), timeout=grace_s + 2 * GUARD_MARGIN_S)
    ray.kill(owner)
