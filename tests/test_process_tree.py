"""Process trees the host owns: stopped on the virtual clock's exact schedule, and — with real
processes — gone when their owner is cancelled, killed, or when their leader exits by itself."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio

from tests.processes import kill_all, processes_with
from trio_gym.processes import run_process_tree
from trio_gym.processes.guard import stop_tree
from trio_gym.processes.tree import GUARD_MARGIN_S, stop_guard

HANG_GUARD_S = 60
VIRTUAL_HANG_GUARD_S = 3600  # on the virtual clock: a test that would hang fails at once
REPO = Path(__file__).resolve().parent.parent


@attrs.define
class FakeProcess:
    appears_at: float = 0.0
    term_takes_s: float | None = 1.0
    """How long it takes to exit after SIGTERM; ``None``: it ignores SIGTERM."""
    ends_at: float = math.inf


@attrs.define
class FakeTree:
    """Processes on the virtual clock: who is there, what they were sent, when they go."""

    processes: dict[int, FakeProcess]
    sent: list[tuple[float, int, int]] = attrs.field(factory=list)

    def _alive(self, pid: int) -> bool:
        now = trio.current_time()
        process = self.processes[pid]
        return process.appears_at <= now < process.ends_at

    def members(self) -> set[int]:
        return {pid for pid in self.processes if self._alive(pid)}

    def signal(self, pids: set[int], signum: int) -> None:
        now = trio.current_time()
        for pid in pids:
            self.sent.append((now, pid, signum))
            process = self.processes[pid]
            if signum == signal.SIGKILL:
                process.ends_at = min(process.ends_at, now)
            elif process.term_takes_s is not None:
                process.ends_at = min(process.ends_at, now + process.term_takes_s)

    async def wait_gone(self, pids: set[int]) -> None:
        for pid in pids:
            await trio.sleep_until(self.processes[pid].ends_at)


async def test_a_tree_that_obeys_sigterm_is_never_killed(autojump_clock: trio.abc.Clock) -> None:
    tree = FakeTree({1: FakeProcess(term_takes_s=0.5), 2: FakeProcess(term_takes_s=3)})
    with trio.fail_after(VIRTUAL_HANG_GUARD_S):
        await stop_tree(tree, grace_s=10)
    assert trio.current_time() == 3
    assert tree.sent == [(0, 1, signal.SIGTERM), (0, 2, signal.SIGTERM)]


async def test_what_outlives_the_grace_is_killed_at_its_end(autojump_clock: trio.abc.Clock) -> None:
    tree = FakeTree(
        {
            1: FakeProcess(term_takes_s=1),
            2: FakeProcess(term_takes_s=None),  # ignores SIGTERM
            3: FakeProcess(appears_at=4, term_takes_s=None),  # forked during the grace
        }
    )
    with trio.fail_after(VIRTUAL_HANG_GUARD_S):
        await stop_tree(tree, grace_s=10)
    assert trio.current_time() == 10
    killed = sorted((at, pid) for at, pid, signum in tree.sent if signum == signal.SIGKILL)
    assert killed == [(10, 2), (10, 3)]
    assert not tree.members()


@attrs.define
class FakeGuard:
    exits_after_lifeline_s: float
    """A guard that takes "forever" takes 10,000 s here: a shielded wait cannot be cut from
    outside, so a test of the bound must end even when the bound is broken."""
    pid: int = -1  # no process: the forced stop finds no tree to kill
    lifeline_closed_at: float | None = None
    killed_at: float | None = None
    returncode: int | None = None
    _killed: trio.Event = attrs.field(factory=trio.Event)

    async def aclose(self) -> None:  # the lifeline
        self.lifeline_closed_at = trio.current_time()

    async def wait(self) -> int:
        assert self.lifeline_closed_at is not None
        with trio.move_on_at(self.lifeline_closed_at + self.exits_after_lifeline_s):
            await self._killed.wait()
        if self.returncode is None:
            self.returncode = 0
        return self.returncode

    def kill(self) -> None:
        self.killed_at = trio.current_time()
        self.returncode = -9
        self._killed.set()


async def test_a_guard_that_stops_its_tree_in_time_is_waited_for(
    autojump_clock: trio.abc.Clock,
) -> None:
    guard = FakeGuard(exits_after_lifeline_s=7)
    with trio.CancelScope() as scope:
        scope.cancel()  # the owner is being cancelled: the stop still runs to its end
        await stop_guard(guard, guard, grace_s=10, name="t")
    assert guard.lifeline_closed_at == 0 and trio.current_time() == 7 and guard.killed_at is None


async def test_a_guard_that_does_not_exit_is_killed_after_grace_and_margin(
    autojump_clock: trio.abc.Clock,
) -> None:
    guard = FakeGuard(exits_after_lifeline_s=10_000)
    await stop_guard(guard, guard, grace_s=10, name="t")
    assert guard.killed_at == 10 + GUARD_MARGIN_S


# --- real processes ---------------------------------------------------------------------------

TREE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from pathlib import Path
    kind = sys.argv[1]
    if kind == "leader":
        for child in ("plain", "own-group", "stubborn", "orphan", "escapee"):
            subprocess.Popen([sys.executable, __file__, child])
        time.sleep(float(sys.argv[2]))
        sys.exit(5)
    if kind in ("own-group", "escapee"):
        os.setpgid(0, 0)  # out of the leader's group, as Ray's workers go
    if kind == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if kind in ("orphan", "escapee"):
        parent = os.getpid()
        if os.fork():
            os._exit(0)
        while os.getppid() == parent:  # orphaned: found only as the guard's (subreaper's) child
            time.sleep(0.01)
    Path(f"ready-{kind}").touch()  # in the working directory: the tree has settled
    time.sleep(3600)
    """
)
KINDS = ("plain", "own-group", "stubborn", "orphan", "escapee")


async def until_settled(directory: Path) -> None:
    """Until every process of TREE has done what it does first (left its group, been orphaned)."""
    with trio.fail_after(HANG_GUARD_S):
        while not all((directory / f"ready-{kind}").exists() for kind in KINDS):  # noqa: ASYNC110
            await trio.sleep(0.02)  # other processes' progress: nothing to wait on but looking


def tree_script(tmp_path: Path) -> Path:
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    return script


def tagged(tag: str) -> list[int]:
    return processes_with("TREE_TAG", tag)


async def until_tagged(tag: str, count: int) -> None:
    with trio.fail_after(HANG_GUARD_S):
        while len(tagged(tag)) != count:  # noqa: ASYNC110 - other processes cannot be awaited
            await trio.sleep(0.02)


@pytest.fixture
def tag() -> Iterator[str]:
    """A tag for one test's tree; whatever carries it when the test ends (the rule it checks
    was broken) is killed, so one failure does not leave processes behind for the next."""
    tag = uuid.uuid4().hex
    yield tag
    kill_all("TREE_TAG", tag)


async def test_cancelling_the_owner_stops_every_process_of_the_tree(
    tmp_path: Path, tag: str
) -> None:
    argv = [sys.executable, str(tree_script(tmp_path)), "leader", "3600"]
    env = {**os.environ, "TREE_TAG": tag}
    async with trio.open_nursery() as nursery:
        tree = await nursery.start(
            lambda task_status: run_process_tree(
                argv,
                name="t",
                env=env,
                cwd=str(tmp_path),
                stop_grace_s=0.5,
                task_status=task_status,
            )
        )
        await until_settled(tmp_path)
        assert len(tagged(tag)) == 7  # the guard, the leader and its five
        nursery.cancel_scope.cancel()
    assert tagged(tag) == []  # nothing left once the owner's task has ended
    assert tree.ended


async def test_a_leader_that_exits_by_itself_ends_the_tree_with_its_status(
    tmp_path: Path, tag: str
) -> None:
    argv = [sys.executable, str(tree_script(tmp_path)), "leader", "0.5"]
    env = {**os.environ, "TREE_TAG": tag}
    with trio.fail_after(HANG_GUARD_S):
        status = await run_process_tree(
            argv, name="t", env=env, cwd=str(tmp_path), stop_grace_s=0.5
        )
    assert status == 5
    assert tagged(tag) == []


CHATTY = textwrap.dedent(
    """
    import signal, sys, time
    def stop(signum, frame):
        for _ in range(5000):  # far more than a pipe holds
            print("x" * 100)
        print("stopped cleanly", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("up", flush=True)
    time.sleep(3600)
    """
)


async def test_what_a_stopping_tree_prints_is_read_while_it_stops(tmp_path: Path, tag: str) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    env = {**os.environ, "TREE_TAG": tag}
    async with trio.open_nursery() as nursery:
        tree = await nursery.start(
            lambda task_status: run_process_tree(
                [sys.executable, str(script)],
                name="t",
                env=env,
                cwd=str(tmp_path),
                stop_grace_s=30,
                task_status=task_status,
            )
        )
        with trio.fail_after(HANG_GUARD_S):
            while "up" not in tree.output.text():  # noqa: ASYNC110 - another process's pace
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    assert tree.output.text().endswith("stopped cleanly")  # not blocked on a full pipe, killed


OWNER = textwrap.dedent(
    """
    import os, signal, sys, trio
    from trio_gym.processes import run_process_tree

    async def main():
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(lambda task_status: run_process_tree(
                    sys.argv[1:], name="t", env=dict(os.environ), cwd=".", stop_grace_s=0.5,
                    task_status=task_status))
                async for _ in signals:  # SIGTERM: stop as a host stops, then exit
                    nursery.cancel_scope.cancel()

    trio.run(main)
    """
)


@pytest.mark.parametrize(
    ("signum", "whole_group"),
    [(signal.SIGKILL, False), (signal.SIGTERM, False), (signal.SIGKILL, True)],
    ids=["SIGKILL", "SIGTERM", "SIGKILL-to-its-group"],
)
async def test_a_tree_does_not_outlive_its_owner_however_the_owner_dies(
    tmp_path: Path, tag: str, signum: int, whole_group: bool
) -> None:
    owner = await trio.lowlevel.open_process(
        [sys.executable, "-c", OWNER, sys.executable, str(tree_script(tmp_path)), "leader", "3600"],
        env={**os.environ, "TREE_TAG": tag, "PYTHONPATH": str(REPO)},  # this checkout's trio_gym
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        start_new_session=True,  # a group of its own, to be killed whole
    )
    try:
        await until_settled(tmp_path)
        assert len(tagged(tag)) == 8  # the owner too carries the tag
        if whole_group:  # the guard is in a session of its own: it outlives its owner's group
            os.killpg(owner.pid, signum)
        else:
            owner.send_signal(signum)
        with trio.fail_after(HANG_GUARD_S):
            await owner.wait()
        if signum == signal.SIGTERM:
            assert tagged(tag) == []  # an owner that stops waits for its tree to be gone
        else:
            await until_tagged(tag, 0)  # a killed owner's guard does it on its own
    finally:
        if owner.returncode is None:
            owner.kill()
        await owner.wait()
