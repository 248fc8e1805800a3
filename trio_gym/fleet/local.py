"""Hosts as child processes of the trainer: ``trio-gym serve --port 0`` on this machine.

Each host is a guarded process tree (:mod:`trio_gym.processes`) run by a task of the
provider's nursery: leaving ``hosts()`` cancels those tasks, and each stops its tree — SIGTERM,
then SIGKILL after ``stop_grace_s`` — before the block is left. If the trainer itself dies, the
guards' lifelines close and the hosts are stopped the same way. The port a host chose is read
back from its ``--port-file``; its output goes to the trainer's log (``process_output`` events)
and the end of it into any launch failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import attrs
import trio

from trio_gym.fleet.launch import HostSpec, Launches, new_identity, wait_ready
from trio_gym.processes import ProcessTree, run_process_tree
from trio_gym.trainer.hosts import HostHandle


@attrs.define(eq=False)
class _Running:
    tree: ProcessTree
    scope: trio.CancelScope


class LocalProvider:
    """Launches hosts as local child processes; one ``hosts()`` block at a time.

    ``python`` runs ``-m trio_gym serve`` (default: this interpreter); ``bind`` is the address
    the hosts listen on and the trainer reaches them by.
    """

    def __init__(
        self,
        *,
        python: str = sys.executable,
        bind: str = "127.0.0.1",
        poll_interval_s: float = 0.2,
    ) -> None:
        self.python = python
        self.bind = bind
        self.poll_interval_s = poll_interval_s
        self._running: dict[str, _Running] = {}
        self._launches = Launches("local")
        self._launch: tuple[HostSpec, Path] | None = None

    @contextlib.asynccontextmanager
    async def hosts(self, n: int, spec: HostSpec) -> AsyncIterator[list[HostHandle]]:
        with tempfile.TemporaryDirectory(prefix="trio-gym-hosts-") as directory:
            async with self._launches.block():
                self._launch = (spec, Path(directory))
                yield await self._launches.start_many(n, self._run_host)

    async def alive(self, handle: HostHandle) -> bool:
        running = self._running.get(handle.name)
        return running is not None and not running.tree.ended

    def host_pid(self, handle: HostHandle) -> int | None:
        """The pid of ``handle``'s host process while it runs (the guard's one child)."""
        running = self._running.get(handle.name)
        if running is None or running.tree.ended:
            return None
        guard = running.tree.guard.pid
        try:
            children = Path(f"/proc/{guard}/task/{guard}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    async def replace(self, handle: HostHandle) -> HostHandle:
        running = self._running.get(handle.name)
        if running is not None:
            running.scope.cancel()  # stopped by its own task, beside the new one's start
        return await self._launches.start(self._run_host, self._launches.new_name())

    async def _run_host(
        self, name: str, *, task_status: trio.TaskStatus[HostHandle] = trio.TASK_STATUS_IGNORED
    ) -> None:
        assert self._launch is not None
        spec, directory = self._launch
        port_file = directory / f"{name}.port"
        identity = new_identity()
        argv = [
            *(self.python, "-m", "trio_gym", "serve"),
            *("--host", self.bind, "--port", "0", "--port-file", str(port_file)),
            *spec.serve_args,
        ]
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                tree: ProcessTree = await nursery.start(
                    partial(
                        run_process_tree,
                        argv,
                        name=name,
                        env={**os.environ, **spec.host_environment(identity)},
                        cwd=os.getcwd(),
                        stop_grace_s=spec.stop_grace_s,
                    )
                )
                self._running[name] = _Running(tree, scope)
                handle = await wait_ready(
                    name,
                    locate=partial(self._locate, name, port_file, spec, identity),
                    ended=partial(_ended, tree),
                    log_tail=partial(_log_tail, tree),
                    timeout_s=spec.ready_timeout_s,
                    poll_interval_s=self.poll_interval_s,
                )
                task_status.started(handle)

    async def _locate(
        self, name: str, port_file: Path, spec: HostSpec, identity: str
    ) -> HostHandle | None:
        try:
            port = int(await trio.Path(port_file).read_text())
        except (FileNotFoundError, ValueError):
            return None  # not listening yet (the file appears whole, by a rename)
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return HostHandle(
            name, f"http://{host}:{port}", control_token=spec.control_token, identity=identity
        )


async def _ended(tree: ProcessTree) -> str | None:
    if not tree.ended:
        return None
    return f"exited with status {tree.guard.returncode}"


async def _log_tail(tree: ProcessTree) -> str:
    tail = tree.output.text()
    if not tail:
        return "it printed nothing"
    return "the end of its output:\n" + tail
