"""The dispatch gate: what a checkpoint counts is what was really submitted."""

from __future__ import annotations

import trio
import trio.testing

from trio_gym.trainer.gate import DispatchGate
from trio_gym.trainer.ledger import AttemptState, Ledger


async def dispatch(gate: DispatchGate, ledger: Ledger, key: str, submitted: list[str]) -> None:
    """The dispatch order the gate exists for: pass the gate, then mark and submit together."""
    async with gate.admission(), ledger.mutation():
        ledger.move(key, AttemptState.DISPATCHED)
        submitted.append(key)


async def test_a_checkpoint_never_counts_an_attempt_waiting_at_the_gate(
    autojump_clock: trio.abc.Clock,
) -> None:
    gate, ledger, submitted = DispatchGate(), Ledger(), list[str]()
    async with ledger.mutation():
        ledger.add_group("g1", ["http://a", "http://a"])
    async with trio.open_nursery() as nursery:
        await dispatch(gate, ledger, "g1.0", submitted)  # before the checkpoint
        await gate.close()  # the checkpoint
        nursery.start_soon(dispatch, gate, ledger, "g1.1", submitted)
        await trio.sleep(60)  # the checkpoint's prepare, commit and drain
        counted = [a.capture_key for a in ledger.in_state(AttemptState.DISPATCHED)]
        assert counted == submitted == ["g1.0"]  # the waiting one is neither marked nor sent
        gate.open()
    assert submitted == ["g1.0", "g1.1"]


async def test_closing_waits_for_an_admission_under_way(autojump_clock: trio.abc.Clock) -> None:
    gate = DispatchGate()
    events: list[str] = []

    async def slow_submission() -> None:
        async with gate.admission():
            events.append("admitted")
            await trio.sleep(5)
            events.append("submitted")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow_submission)
        await trio.testing.wait_all_tasks_blocked()
        await gate.close()
        events.append("closed")
        assert not gate.is_open and trio.current_time() == 5
        gate.open()
    assert events == ["admitted", "submitted", "closed"]
