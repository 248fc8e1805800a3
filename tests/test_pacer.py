"""The pacer: one timer that wakes every heartbeat at the time it asked for."""

from __future__ import annotations

import trio
import trio.testing

from trio_gym.host.pacer import Pacer


async def test_sleepers_wake_at_their_own_times_in_order(autojump_clock: trio.abc.Clock) -> None:
    pacer = Pacer()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, at: float) -> None:
        await pacer.sleep_until(at)
        woke.append((name, trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(sleeper, "late", 5.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(sleeper, "early", 2.0)  # earlier than the pacer sleeps for
        nursery.start_soon(sleeper, "tie", 2.0)
        await trio.sleep(6)
        nursery.cancel_scope.cancel()
    assert dict(woke) == {"early": 2.0, "tie": 2.0, "late": 5.0}
    assert [at for _, at in woke] == [2.0, 2.0, 5.0]  # woken in time order


async def test_a_cancelled_sleeper_leaves_the_others_on_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    pacer = Pacer()
    woke: list[float] = []

    async def sleeper(at: float) -> None:
        await pacer.sleep_until(at)
        woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pacer.run)
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(1):
            await pacer.sleep_until(3.0)
        nursery.start_soon(sleeper, 4.0)
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert woke == [4.0] and trio.current_time() >= 5


async def test_without_a_running_pacer_a_sleeper_sleeps_alone(
    autojump_clock: trio.abc.Clock,
) -> None:
    pacer = Pacer()
    await pacer.sleep_until(7.0)
    assert trio.current_time() == 7.0


async def test_sleepers_finish_alone_when_the_pacer_stops(autojump_clock: trio.abc.Clock) -> None:
    pacer = Pacer()
    woke: list[float] = []

    async def sleeper() -> None:
        await pacer.sleep_until(10.0)
        woke.append(trio.current_time())

    pacing = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper)  # before the pacer runs: sleeps alone
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_run_in, pacer, pacing)
        await trio.sleep(1)
        nursery.start_soon(sleeper)  # on the pacer, which then stops
        await trio.testing.wait_all_tasks_blocked()
        pacing.cancel()
    assert woke == [10.0, 10.0]


async def _run_in(pacer: Pacer, scope: trio.CancelScope) -> None:
    with scope:
        await pacer.run()


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
