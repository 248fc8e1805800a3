"""``Changes``, the one way the code here waits for something to change."""

from __future__ import annotations

import trio
import trio.testing

from trio_gym.changes import Changes


async def test_every_waiter_wakes_at_a_note_and_sleeps_again_until_the_next() -> None:
    changes = Changes()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await changes.wait()
        woken.append(n)
        await changes.wait()
        woken.append(n + 10)

    async with trio.open_nursery() as nursery:
        for n in range(3):
            nursery.start_soon(waiter, n)
        await trio.testing.wait_all_tasks_blocked()
        assert woken == []
        changes.note()
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(woken) == [0, 1, 2]  # each once: the second wait sleeps
        changes.note()
    assert sorted(woken) == [0, 1, 2, 10, 11, 12]


async def test_until_returns_at_once_when_it_holds_and_else_at_the_change_that_makes_it() -> None:
    changes = Changes()
    state = {"n": 0}
    with trio.fail_after(1):
        await changes.until(lambda: True)
    returned = trio.Event()

    async def wait_for_two() -> None:
        await changes.until(lambda: state["n"] == 2)
        returned.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_two)
        for n in (1, 2):
            await trio.testing.wait_all_tasks_blocked()
            assert not returned.is_set()
            state["n"] = n
            changes.note()
    assert returned.is_set()
