"""The pacer: one timer that calls every heartbeat at its own times."""

from __future__ import annotations

import gc
import weakref

import pytest
import trio
import trio.testing

from trio_gym.host.pacer import COMPACT_AT, RESOLUTION_S, Pacer


async def test_beats_are_called_at_their_own_times_in_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    pacer = Pacer()
    calls: list[tuple[str, float]] = []

    def beat(name: str) -> None:
        calls.append((name, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.testing.wait_all_tasks_blocked()
        slow = pacer.start_every(5.0, lambda: beat("slow"))
        await trio.testing.wait_all_tasks_blocked()  # the pacer now sleeps until 5
        fast = pacer.start_every(2.0, lambda: beat("fast"))  # due earlier than that
        await trio.sleep(10.5)
        slow.stop()
        fast.stop()
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert [at for name, at in calls if name == "fast"] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert [at for name, at in calls if name == "slow"] == [5.0, 10.0]
    assert [at for _, at in calls] == sorted(at for _, at in calls)  # called in time order


async def test_periodic_calls_need_a_running_pacer(autojump_clock: trio.abc.Clock) -> None:
    with pytest.raises(RuntimeError, match="running pacer"):
        Pacer().start_every(1.0, lambda: None)


async def test_a_beat_that_raises_is_dropped_and_the_others_go_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    pacer = Pacer()
    calls: list[tuple[str, float]] = []

    def broken() -> None:
        calls.append(("broken", trio.current_time()))
        raise RuntimeError("a bug in a beat")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.testing.wait_all_tasks_blocked()
        pacer.start_every(1.0, broken)
        steady = pacer.start_every(1.0, lambda: calls.append(("steady", trio.current_time())))
        await trio.sleep(3.5)
        steady.stop()
        await trio.sleep(2)
        nursery.cancel_scope.cancel()
    assert [c for c in calls if c[0] == "broken"] == [("broken", 1.0)]
    assert [at for name, at in calls if name == "steady"] == [1.0, 2.0, 3.0]


async def test_a_timed_call_is_made_once_unless_stopped_first(
    autojump_clock: trio.abc.Clock,
) -> None:
    pacer = Pacer()
    calls: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.testing.wait_all_tasks_blocked()
        pacer.call_after(2.0, lambda: calls.append(("kept", trio.current_time())))
        stopped = pacer.call_after(1.0, lambda: calls.append(("stopped", trio.current_time())))
        await trio.sleep(0.5)
        stopped.stop()
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert calls == [("kept", 2.0)]


async def test_beats_due_close_together_share_one_wake_up(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Every wake-up of the pacer costs an expiring cancel scope; beats due within
    RESOLUTION_S of the last wake-up wait for the next one (a stream of short batches each
    starting a watcher timer would otherwise wake it for each)."""
    pacer = Pacer()
    called: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.testing.wait_all_tasks_blocked()
        for due in (1.0, 1.0002, 1.0004):
            pacer.call_after(due, lambda: called.append(trio.current_time()))
        await trio.sleep(2)
        nursery.cancel_scope.cancel()
    assert called == pytest.approx([1.0, 1.0 + RESOLUTION_S, 1.0 + RESOLUTION_S])


async def test_a_stopped_beat_lets_go_at_once_and_stopped_beats_do_not_pile_up(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A short batch stops its heartbeat long before it is due: the beat must not keep the
    batch's connection alive until then, and thousands of them must not grow the heap."""

    class Connection:  # stands for what a heartbeat holds
        def beat(self) -> None:
            raise AssertionError("a stopped beat was called")

    pacer = Pacer()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.testing.wait_all_tasks_blocked()
        held = Connection()
        gone = weakref.ref(held)
        pacer.start_every(60.0, held.beat).stop()
        del held
        gc.collect()
        assert gone() is None
        for _ in range(20 * COMPACT_AT):
            pacer.start_every(60.0, lambda: None).stop()
        assert len(pacer._beats) <= 2 * COMPACT_AT  # the heap itself is the rule
        nursery.cancel_scope.cancel()
