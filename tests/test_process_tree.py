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
from pathlib import Path

import attrs
import pytest
import trio

from trio_gym.processes import run_process_tree
from trio_gym.processes.guard import stop_tree
from trio_gym.processes.tree import GUARD_MARGIN_S, stop_guard

HANG_GUARD_S = 60


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
    await stop_tree(tree, grace_s=10)
    assert trio.current_time() == 10
    killed = sorted((at, pid) for at, pid, signum in tree.sent if signum == signal.SIGKILL)
    assert killed == [(10, 2), (10, 3)]
    assert not tree.members()


@attrs.define
class FakeGuard:
    exits_after_lifeline_s: float | None
    lifeline_closed_at: float | None = None
    killed_at: float | None = None
    returncode: int | None = None
    _exited: trio.Event = attrs.field(factory=trio.Event)

    async def aclose(self) -> None:  # the lifeline
        self.lifeline_closed_at = trio.current_time()

    async def wait(self) -> int:
        if self.exits_after_lifeline_s is not None and self.lifeline_closed_at is not None:
            await trio.sleep_until(self.lifeline_closed_at + self.exits_after_lifeline_s)
            self.returncode = 0
            return 0
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        self.killed_at = trio.current_time()
        self.returncode = -9
        self._exited.set()


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
    guard = FakeGuard(exits_after_lifeline_s=None)
    await stop_guard(guard, guard, grace_s=10, name="t")
    assert guard.killed_at == 10 + GUARD_MARGIN_S


# --- real processes ---------------------------------------------------------------------------

TREE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    kind = sys.argv[1]
    if kind == "leader":
        for child in ("plain", "own-group", "stubborn", "orphan"):
            subprocess.Popen([sys.executable, __file__, child])
        print("tree up", flush=True)
        time.sleep(float(sys.argv[2]))
        sys.exit(5)
    if kind == "own-group":
        os.setpgid(0, 0)
    if kind == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if kind == "orphan" and os.fork():
        os._exit(0)  # its child is orphaned at once
    time.sleep(3600)
    """
)


def tree_script(tmp_path: Path) -> Path:
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    return script


def tagged(tag: str) -> list[int]:
    marker = f"TREE_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


async def until_tagged(tag: str, count: int) -> None:
    with trio.fail_after(HANG_GUARD_S):
        while len(tagged(tag)) != count:  # noqa: ASYNC110 - other processes cannot be awaited
            await trio.sleep(0.02)


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex


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
        await until_tagged(
            tag, 6
        )  # the guard, the leader, its four: one left the group, one orphaned
        with trio.fail_after(HANG_GUARD_S):
            while "tree up" not in tree.output.text():  # noqa: ASYNC110 - the leader's own pace
                await trio.sleep(0.02)
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


OWNER = textwrap.dedent(
    """
    import os, sys, trio
    from trio_gym.processes import run_process_tree

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: run_process_tree(
                sys.argv[1:], name="t", env=dict(os.environ), cwd=".", stop_grace_s=0.5,
                task_status=task_status))
            print("owning", flush=True)

    trio.run(main)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
async def test_a_tree_does_not_outlive_its_owner_however_the_owner_dies(
    tmp_path: Path, tag: str, signum: int
) -> None:
    owner = await trio.lowlevel.open_process(
        [sys.executable, "-c", OWNER, sys.executable, str(tree_script(tmp_path)), "leader", "3600"],
        env={**os.environ, "TREE_TAG": tag},
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
    )
    try:
        await until_tagged(tag, 7)  # the owner too carries the tag
        owner.send_signal(signum)
        with trio.fail_after(HANG_GUARD_S):
            await owner.wait()
        await until_tagged(tag, 0)
    finally:
        if owner.returncode is None:
            owner.kill()
        await owner.wait()
