"""The drain waits for the replies in flight, wakes on ledger mutations, and reports briefly."""

from __future__ import annotations

import pickle

import pytest
import trio

from trio_gym.trainer.drain import DrainTimeout, drain
from trio_gym.trainer.ledger import AttemptState, Ledger


async def ledger_with(groups: int, siblings: int = 2) -> Ledger:
    ledger = Ledger()
    async with ledger.mutation():
        for g in range(groups):
            ledger.add_group(f"g{g}", ["http://a"] * siblings)
            for s in range(siblings):
                ledger.move(f"g{g}.{s}", AttemptState.DISPATCHED)
    return ledger


async def settle(ledger: Ledger, key: str, at: float, to: AttemptState) -> None:
    await trio.sleep_until(at)
    async with ledger.mutation():
        ledger.move(key, to)


async def test_the_drain_ends_when_the_last_reply_in_flight_settles(
    autojump_clock: trio.abc.Clock,
) -> None:
    ledger = await ledger_with(50)  # 100 dispatched; two are in flight, the rest were exported
    async with trio.open_nursery() as nursery:
        nursery.start_soon(settle, ledger, "g3.1", 2.5, AttemptState.SEALED)
        nursery.start_soon(settle, ledger, "g7.0", 4.2371, AttemptState.ABANDONED)
        nursery.start_soon(settle, ledger, "g9.0", 1.0, AttemptState.SEALED)  # not waited for
        await drain(ledger, ["g3.1", "g7.0"], timeout_s=60)
        ended = trio.current_time()
    assert ended == 4.2371  # woken by the mutation itself: a poller would come later


async def test_a_drain_that_times_out_reports_a_count_and_a_short_sample(
    autojump_clock: trio.abc.Clock,
) -> None:
    ledger = await ledger_with(20)
    keys = [f"g{g}.0" for g in range(20)]
    with pytest.raises(DrainTimeout) as timed_out:
        await drain(ledger, keys, timeout_s=30)
    error = timed_out.value
    assert (error.count, len(error.sample), trio.current_time()) == (20, 8, 30)
    assert "20 episode(s)" in str(error) and "(and 12 more)" in str(error)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)  # trainers run in workers too
