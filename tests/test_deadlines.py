"""Request deadlines paused by named holders."""

from __future__ import annotations

import math

import trio

from trio_gym.trainer.deadlines import DeadlineRegistry


async def test_a_paused_deadline_stands_still_until_the_last_holder_releases(
    autojump_clock: trio.abc.Clock,
) -> None:
    deadlines = DeadlineRegistry()
    with trio.move_on_after(10) as request:
        deadlines.track(request)
        await trio.sleep(4)  # 6 s left
        deadlines.pause("checkpoint")
        deadlines.pause("refit")
        await trio.sleep(100)
        deadlines.release("checkpoint")  # the refit still holds it
        assert request.deadline == math.inf
        await trio.sleep(100)
        deadlines.release("refit")
        await trio.sleep(1000)
    deadlines.untrack(request)
    assert request.cancelled_caught and trio.current_time() == 4 + 200 + 6


async def test_a_request_that_starts_during_a_pause_waits_for_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    deadlines = DeadlineRegistry()
    deadlines.pause("checkpoint")
    with trio.move_on_after(10) as request:
        deadlines.track(request)
        await trio.sleep(50)
        deadlines.release("checkpoint")
        deadlines.release("checkpoint")  # a second release of the same holder: no effect
        await trio.sleep(1000)
    assert request.cancelled_caught and trio.current_time() == 60
    assert deadlines.holders == frozenset()


async def test_a_release_by_a_holder_that_never_paused_changes_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    deadlines = DeadlineRegistry()
    with trio.move_on_after(10) as request:
        deadlines.track(request)
        deadlines.pause("refit")
        deadlines.release("checkpoint")
        await trio.sleep(30)
        assert not request.cancel_called
        deadlines.release("refit")
        await trio.sleep(30)
    assert request.cancelled_caught and trio.current_time() == 40
