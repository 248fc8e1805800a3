"""A child process tree owned by a trio task, started through the guard (:mod:`.guard`).

``tree = await nursery.start(run_process_tree, argv, ...)`` starts the guard, which starts
``argv`` in a session of its own; the task lives in the owner's nursery for as long as the tree
does. The tree's output is logged line by line (its last lines kept for error messages).
Cancelling the task stops the tree: the lifeline is closed, the guard SIGTERMs every process of
the tree and SIGKILLs what is left after the grace. The wait for that is shielded and bounded
(grace plus a margin, then the guard itself is killed), so a cancelled owner is never held for
longer than that.

If the owner dies instead, the kernel closes the lifeline and the guard does the same.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Final, Protocol

import attrs
import trio

from trio_gym.logs import log_event

from .output import OutputTail

# Beyond the grace, how long the guard gets to finish SIGKILLing and exit.
GUARD_MARGIN_S: Final = 5.0
# Once the tree has ended, how long its last output may take to be read. Only a process that
# escaped the tree could hold the pipe open longer; it is not waited for.
OUTPUT_DRAIN_S: Final = 1.0


class Lifeline(Protocol):
    async def aclose(self) -> None: ...


class GuardProcess(Protocol):
    """The part of :class:`trio.Process` that stopping a guard needs."""

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


async def stop_guard(guard: GuardProcess, lifeline: Lifeline, grace_s: float, name: str) -> None:
    """Close the lifeline and wait for the guard to stop the tree; kill the guard itself if it
    has not exited within ``grace_s`` + :data:`GUARD_MARGIN_S`. Shielded: it runs to the end
    even in a cancelled scope, and that end is bounded."""
    with trio.CancelScope(shield=True):
        await lifeline.aclose()
        with trio.move_on_after(grace_s + GUARD_MARGIN_S):
            await guard.wait()
            return
        log_event("process_tree_guard_killed", process=name, waited_s=grace_s + GUARD_MARGIN_S)
        guard.kill()
        await guard.wait()


@attrs.define(eq=False)
class ProcessTree:
    """A running tree: its guard, the output it printed, and how it ended."""

    name: str
    guard: trio.Process
    output: OutputTail
    _ended: trio.Event = attrs.field(factory=trio.Event)

    @property
    def pid(self) -> int:
        """The guard's pid (the tree's leader is its child)."""
        return self.guard.pid

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    async def wait(self) -> int:
        """Until the tree has ended (its leader exited, or it was stopped): the guard's status,
        which is the leader's own when it exited by itself."""
        await self._ended.wait()
        assert self.guard.returncode is not None
        return self.guard.returncode


async def run_process_tree(
    argv: Sequence[str],
    *,
    name: str,
    env: Mapping[str, str],
    cwd: str,
    stop_grace_s: float,
    task_status: trio.TaskStatus[ProcessTree] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Start ``argv`` as a guarded tree, report it through ``task_status``, and return its
    status once it has ended by itself. Cancelled, it stops the tree first (see the module
    docstring). Raises ``OSError`` if the guard cannot be started.
    """
    guard_argv = [
        sys.executable,
        "-m",
        "trio_gym.processes.guard",
        "--grace",
        repr(stop_grace_s),
        "--",
        *argv,
    ]
    guard = await trio.lowlevel.open_process(
        guard_argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env),
        cwd=cwd,
    )
    assert guard.stdin is not None and guard.stdout is not None
    log_event("process_tree_started", process=name, guard_pid=guard.pid, argv=list(argv))
    tree = ProcessTree(name, guard, OutputTail(name))
    output_read = trio.Event()

    async def read_output(stream: trio.abc.ReceiveStream) -> None:
        await tree.output.pump("output", stream)
        output_read.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_output, guard.stdout)
            task_status.started(tree)
            try:
                await guard.wait()
            finally:
                await stop_guard(guard, guard.stdin, stop_grace_s, name)
                with trio.move_on_after(OUTPUT_DRAIN_S, shield=True):
                    await output_read.wait()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await guard.stdout.aclose()
        tree._ended.set()
        log_event("process_tree_stopped", process=name, status=guard.returncode)
    assert guard.returncode is not None
    return guard.returncode
