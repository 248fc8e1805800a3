"""The guard: a small program that stands between its parent and a process tree, and takes the
tree down when the parent is done with it — or gone.

    python -P .../trio_gym/processes/guard.py --grace SECONDS -- ARGV...

(run by its file: it imports nothing of trio_gym, only trio and the standard library).

The guard starts ``ARGV`` (the tree's *leader*) in a session of its own and then waits for one of:

- its standard input, the *lifeline*, reaching end-of-file. The parent holds the only writing
  end and never writes; the kernel closes it when the parent closes it **or dies, however it
  dies** (a SIGKILL included) — which is how a tree outlives no host;
- SIGTERM, SIGINT or SIGHUP sent to the guard itself (it runs in a session of its own, so
  nothing meant for its parent's process group — a terminal's Ctrl-C, a ``kill`` of the group —
  reaches it: the parent decides, through the lifeline);
- the leader exiting by itself. The guard then exits with the leader's status.

Either way it then stops whatever is left of the tree (:func:`stop_tree`) and exits.

Why a separate process rather than the parent doing this itself:

- ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, and trio forks from
  a worker thread: measured here, a child so started from ``trio.lowlevel.open_process`` was
  killed 10 s later, when trio's idle worker thread went away. The guard forks the leader from
  its main thread, before trio starts, so the leader dies if the guard is killed outright.
- A tree does not stay in one process group (Ray's workers call ``setpgid``) and its middle
  processes die first, orphaning the rest. The guard makes itself a *child subreaper*
  (``PR_SET_CHILD_SUBREAPER``), so every orphaned descendant becomes its child and stays
  findable: the tree is the guard's descendants plus the leader's process group.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Final, Protocol

import trio

# Where pidfds are refused, how often a stopping process is looked at again.
POLL_S: Final = 0.05

_PR_SET_PDEATHSIG: Final = 1
_PR_SET_CHILD_SUBREAPER: Final = 36
_STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class TreeView(Protocol):
    """What :func:`stop_tree` needs: who is there, a way to signal them, and to see them go."""

    def members(self) -> set[int]: ...

    def signal(self, pids: Iterable[int], signum: int) -> None: ...

    async def wait_gone(self, pids: Iterable[int]) -> None: ...


async def stop_tree(tree: TreeView, grace_s: float) -> None:
    """SIGTERM every member; wait up to ``grace_s`` for all to go; then SIGKILL whatever is
    left, again and again, until nothing is (a process forked meanwhile is caught too)."""
    members = tree.members()
    if not members:
        return
    tree.signal(members, signal.SIGTERM)
    with trio.move_on_after(grace_s):
        while members := tree.members():
            await tree.wait_gone(members)
        return
    while members := tree.members():
        tree.signal(members, signal.SIGKILL)
        await tree.wait_gone(members)


class ProcTree:
    """The tree as ``/proc`` shows it: the descendants of ``root`` (not ``root`` itself) and
    every process in process group ``group`` (the leader's, when given). Zombies are not counted;
    with ``reap``, those that are ``root``'s own children (the guard's adopted orphans) are
    collected — only a process that *is* ``root`` may reap, or it would steal its children's
    exit statuses from whoever waits for them."""

    def __init__(
        self, root: int, group: int | None = None, *, reap: bool = False, proc: Path = Path("/proc")
    ) -> None:
        self.root = root
        self.group = group
        self.reap = reap
        self.proc = proc

    def members(self) -> set[int]:
        if self.reap:
            _reap_children()
        children: dict[int, list[int]] = {}
        found: set[int] = set()
        for pid, parent, group in self._processes():
            children.setdefault(parent, []).append(pid)
            if group == self.group:
                found.add(pid)
        descendants: set[int] = set()
        pending = [self.root]
        while pending:
            for child in children.get(pending.pop(), ()):
                if child not in descendants:
                    descendants.add(child)
                    pending.append(child)
        return (found | descendants) - {self.root}

    def signal(self, pids: Iterable[int], signum: int) -> None:
        # Signalled as listed, with no await between: a pid cannot be reused in between.
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    async def wait_gone(self, pids: Iterable[int]) -> None:
        """Until each of ``pids`` has exited. A pidfd works for any process, not only for
        children, so this waits on the kernel; only where pidfds are refused (an old kernel, a
        seccomp filter) does it look again every :data:`POLL_S`."""
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except OSError:
                # No pidfds here: nothing to wait on but looking.
                while (self.proc / str(pid)).exists() and not self._zombie(pid):  # noqa: ASYNC110
                    await trio.sleep(POLL_S)
                continue
            try:
                await trio.lowlevel.wait_readable(pidfd)
            finally:
                os.close(pidfd)

    def _zombie(self, pid: int) -> bool:
        try:
            stat = (self.proc / str(pid) / "stat").read_text()
        except OSError:
            return True
        return stat[stat.rindex(")") + 2 :].startswith("Z")

    def _processes(self) -> list[tuple[int, int, int]]:
        """(pid, parent, process group) of every live process that is not a zombie."""
        found = []
        for entry in self.proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone between the listing and the read
                continue
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z":
                found.append((int(entry.name), int(fields[1]), int(fields[2])))
        return found


def _reap_children(*, sparing: int | None = None) -> None:
    """Collect the exit status of this process's ended children (the guard adopts orphans),
    all but ``sparing`` (the leader, whose status is the guard's own to report)."""
    while True:
        try:
            found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if found is None or found.si_pid == sparing:
            return  # nothing ended; or the leader is first in line: left for its own wait
        os.waitpid(found.si_pid, 0)


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}): {os.strerror(error)}")


def _tied_to(guard: int) -> Callable[[], None]:
    def tie() -> None:  # runs in the leader, between fork and exec
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != guard:  # the guard died before the tie was made
            os.kill(os.getpid(), signal.SIGKILL)

    return tie


async def _until_lifeline_ends(scope: trio.CancelScope) -> None:
    lifeline = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    async with lifeline:
        while await lifeline.receive_some(4096):
            pass
    scope.cancel()


async def _until_signalled(signals: AsyncIterator[int], scope: trio.CancelScope) -> None:
    async for _ in signals:
        scope.cancel()
        return


async def _reap_while_running(leader: int) -> None:
    """Collect adopted orphans as they end, so a long run does not pile up zombies."""
    with trio.open_signal_receiver(signal.SIGCHLD) as children_ended:
        async for _ in children_ended:
            _reap_children(sparing=leader)


async def _leader_exit(leader: subprocess.Popen[bytes]) -> int:
    try:
        pidfd = os.pidfd_open(leader.pid)
    except OSError:  # no pidfds here: a thread waits instead (abandoned if the tree is stopped)
        return await trio.to_thread.run_sync(leader.wait, abandon_on_cancel=True)
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)
    return leader.wait()


async def supervise(
    leader: subprocess.Popen[bytes], grace_s: float, early_signals: Sequence[int] = ()
) -> int:
    """Wait for the lifeline, a signal or the leader; stop the tree; return the exit status.

    ``early_signals`` arrived before trio could receive them: the tree is stopped at once. The
    tree is stopped whatever happens here, an error included."""
    status = 0
    try:
        with trio.open_signal_receiver(*_STOP_SIGNALS) as signals:
            async with trio.open_nursery() as nursery:
                if early_signals:
                    nursery.cancel_scope.cancel()
                nursery.start_soon(_until_lifeline_ends, nursery.cancel_scope)
                nursery.start_soon(_until_signalled, signals, nursery.cancel_scope)
                nursery.start_soon(_reap_while_running, leader.pid)
                code = await _leader_exit(leader)
                status = code if code >= 0 else 128 - code
                nursery.cancel_scope.cancel()
    finally:
        await stop_tree(ProcTree(os.getpid(), group=leader.pid, reap=True), grace_s)
    return status


def start_leader(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """Fork the leader from this (main) thread, in a session of its own, tied to the guard."""
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_tied_to(os.getpid()),
    )


def main(argv: Collection[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="guard.py")
    parser.add_argument("--grace", type=float, required=True, help="SIGTERM to SIGKILL, seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- ARGV...")
    args = parser.parse_args(None if argv is None else list(argv))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to guard: give it after --")
    # Signals are received by trio once it runs; one that comes earlier is remembered, so the
    # tree is stopped as soon as it can be instead of the guard dying before it could stop it.
    # (Caught signals return to their default in the leader when it execs.)
    early: list[int] = []
    for signum in _STOP_SIGNALS:
        signal.signal(signum, lambda received, frame: early.append(received))
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    try:
        leader = start_leader(command)
    except OSError as exc:
        print(f"trio-gym guard: cannot start {command[0]}: {exc}", file=sys.stderr, flush=True)
        return 127
    return trio.run(supervise, leader, args.grace, early)


if __name__ == "__main__":
    sys.exit(main())
