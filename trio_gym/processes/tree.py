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

import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, Protocol

import attrs
import trio

from trio_gym.logs import log_event

from .guard import ProcTree
from .output import OutputTail

GUARD: Final = Path(__file__).with_name("guard.py")
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

    @property
    def pid(self) -> int: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


async def stop_guard(guard: GuardProcess, lifeline: Lifeline, grace_s: float, name: str) -> None:
    """Close the lifeline and wait for the guard to stop the tree. A guard that has not exited
    within ``grace_s`` + :data:`GUARD_MARGIN_S` is stopped by force: every process of its tree
    (its descendants, orphans included: it is their subreaper) is SIGKILLed, then the guard.
    Shielded: it runs to the end even in a cancelled scope, and that end is bounded."""
    with trio.CancelScope(shield=True):
        await lifeline.aclose()
        with trio.move_on_after(grace_s + GUARD_MARGIN_S):
            await guard.wait()
            return
        log_event("process_tree_guard_killed", process=name, waited_s=grace_s + GUARD_MARGIN_S)
        tree = ProcTree(guard.pid)  # only the guard may reap: this process just looks
        tree.signal(tree.members(), signal.SIGKILL)
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
    def ended(self) -> bool:
        return self._ended.is_set()

    def count_processes(self) -> int:
        """How many processes run under the guard now (its descendants, orphans included). It
        reads all of ``/proc``: call it from a worker thread."""
        return 0 if self.ended else len(ProcTree(self.guard.pid).members())

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
    remember: re.Pattern[str] | None = None,
    task_status: trio.TaskStatus[ProcessTree] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Start ``argv`` as a guarded tree, report it through ``task_status``, and return its
    status once it has ended by itself. Cancelled, it stops the tree first (see the module
    docstring). Its output keeps the first line matching ``remember``. Raises ``OSError`` if
    the guard cannot be started.
    """
    # The guard is run by its file, in isolated mode: this very code and this interpreter's own
    # packages, whatever the working directory and PYTHONPATH (an environment's wheels) say.
    guard_argv = [sys.executable, "-I", str(GUARD), "--grace", repr(stop_grace_s), "--", *argv]
    guard = await trio.lowlevel.open_process(
        guard_argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env),
        cwd=cwd,
        # A session of its own: signals meant for this process's group (a terminal's Ctrl-C, a
        # kill of the group) do not reach it; this process's end does, through the lifeline.
        start_new_session=True,
    )
    assert guard.stdin is not None and guard.stdout is not None
    log_event("process_tree_started", process=name, guard_pid=guard.pid, argv=list(argv))
    tree = ProcessTree(name, guard, OutputTail(name, remember=remember))
    try:
        async with trio.open_nursery() as running:
            running.start_soon(tree.output.pump, "output", guard.stdout)
            task_status.started(tree)
            await guard.wait()
            running.cancel_scope.cancel()
    finally:
        # The tree is stopped (bounded), and its output read meanwhile — a process writing as
        # it stops would otherwise block on a full pipe until SIGKILLed — and for at most
        # OUTPUT_DRAIN_S after: only a process that escaped the tree could hold the pipe longer.
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as stopping:
                stopping.start_soon(tree.output.pump, "output", guard.stdout)
                await stop_guard(guard, guard.stdin, stop_grace_s, name)
                stopping.cancel_scope.deadline = trio.current_time() + OUTPUT_DRAIN_S
            await guard.stdout.aclose()
        tree._ended.set()
        log_event("process_tree_stopped", process=name, status=guard.returncode)
    assert guard.returncode is not None
    return guard.returncode
