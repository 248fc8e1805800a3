"""Checkpoint-aware dispatch over row streams, on a virtual clock with in-process hosts."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import pytest
import trio

from tests.fleet import calendar, crash, fleet, restart, uninterrupted
from trio_gym.runners import ExampleContext, ExampleRunner
from trio_gym.trainer import ClientSettings, RolloutClient
from trio_gym.trainer.coordinator import CheckpointCoordinator, CheckpointSettings
from trio_gym.trainer.dispatch import Dispatcher, DispatchSettings, GroupFailed, SealedResult
from trio_gym.trainer.ledger import AttemptState, Ledger, LedgerError

NO_REATTACH = ClientSettings(request_deadline_s=10**7, max_reattaches=0)
"""For the rules of a cut that no reattach mends (a host that kept nothing, a proxy that cuts
every time)."""


def states(ledger: Any, group_id: str) -> list[list[tuple[str, int, str]]]:
    """Every sibling's attempts as (rollout id, attempt, state)."""
    return [
        [(a.rollout_id, a.number, a.state.value) for a in sibling.attempts]
        for sibling in ledger.groups[group_id].siblings
    ]


async def test_a_group_runs_on_its_hosts_and_each_result_is_consumed_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    examples = [calendar(seed) for seed in range(4)]
    async with fleet() as f:
        await f.dispatcher.run_group("g", examples)
    ledger = f.dispatcher.ledger
    assert [row[-1][2] for row in states(ledger, "g")] == ["sealed"] * 4
    assert sorted(r.sibling for r in f.consumed) == [0, 1, 2, 3]
    assert [a.host for a in ledger.in_state(AttemptState.SEALED)] == ["a", "b", "a", "b"]
    for sealed in f.consumed:
        expected = await uninterrupted(examples[sealed.sibling])
        assert sealed.result["booked"] == expected["booked"]
        assert sealed.result["_ng_rollout_id"] == sealed.rollout_id
        assert sealed.error is None
    assert [len(f.runners[h].completed) for h in "ab"] == [2, 2]


async def test_an_attempt_waiting_at_the_closed_gate_is_not_marked_dispatched(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet() as f:
        await f.dispatcher.gate.close()
        f.nursery.start_soon(f.dispatcher.run_group, "g", [calendar(1), calendar(2)])
        await trio.sleep(100)
        ledger = f.dispatcher.ledger
        assert [row[-1][2] for row in states(ledger, "g")] == ["reserved"] * 2
        assert not any(runner.started for runner in f.runners.values())  # nothing reached a host
        f.dispatcher.gate.open()
        await trio.sleep(100)
        assert [row[-1][2] for row in states(ledger, "g")] == ["sealed"] * 2


async def test_admission_refusals_cost_nothing_and_are_resent_once_admission_reopens(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet(dispatch=DispatchSettings(admission_retry_s=1.0)) as f:
        control = f.dispatcher.hosts["a"].control
        await control.prepare("someone-else", timeout_s=10)  # admission closed, not by us
        async with trio.open_nursery() as nursery:
            group = [calendar(1), calendar(2), calendar(3)]
            nursery.start_soon(f.dispatcher.run_group, "g", group)
            await trio.sleep(10.5)
            assert f.dispatcher.admission_closed_rows_total >= 2 * 10  # two rows, every second
            await control.resume("someone-else", timeout_s=10)
    assert len(f.consumed) == 3
    ledger = f.dispatcher.ledger
    # One attempt per sibling, the identity it was born with: nothing was spent.
    assert states(ledger, "g") == [[(f"g.{i}@{ledger.incarnation}", 0, "sealed")] for i in range(3)]


async def test_a_host_whose_admission_never_reopens_ends_the_group_not_the_loop(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet(("a",), dispatch=DispatchSettings(max_admission_refusals=3)) as f:
        await f.dispatcher.hosts["a"].control.prepare("forever", timeout_s=10)
        with pytest.raises(GroupFailed, match="admission never reopened") as failed:
            await f.dispatcher.run_group("g", [calendar(1)])
    assert "refused admission_closed 4 times" in str(failed.value)
    assert f.dispatcher.admission_closed_rows_total == 4


async def test_rows_missing_from_a_cut_stream_are_abandoned_retired_and_resent_under_a_new_id(
    autojump_clock: trio.abc.Clock,
) -> None:
    examples = [calendar(1, think_s=1.0), calendar(2, think_s=50.0)]
    consumed: list[SealedResult] = []

    def cut_after_the_first_row(sealed: SealedResult) -> None:
        consumed.append(sealed)
        f.cuts["a"][0].set()

    async with fleet(("a",), client=NO_REATTACH, on_result=cut_after_the_first_row) as f:
        await f.dispatcher.run_group("g", examples)
        status = f.hosts["a"].services.checkpoints.status()
    ledger = f.dispatcher.ledger
    token = ledger.incarnation
    assert states(ledger, "g") == [
        [(f"g.0@{token}", 0, "sealed")],
        [(f"g.1@{token}", 0, "abandoned"), (f"g.1@{token}.g1", 0, "sealed")],
    ]
    assert status.counts.retired == 1  # the lost attempt was retired on its host ...
    assert len(f.runners["a"].cancelled) == 1  # ... which stopped running it at once
    assert f.dispatcher.to_retire["a"] == set()
    assert [r.rollout_id for r in consumed] == [f"g.0@{token}", f"g.1@{token}.g1"]
    expected = await uninterrupted(examples[1])
    assert consumed[1].result["booked"] == expected["booked"]


async def test_a_stream_cut_while_its_host_lives_reattaches_and_no_row_is_lost(
    autojump_clock: trio.abc.Clock,
) -> None:
    examples = [calendar(1, think_s=1.0), calendar(2, think_s=50.0)]
    consumed: list[SealedResult] = []

    def cut_after_the_first_row(sealed: SealedResult) -> None:
        consumed.append(sealed)
        f.cuts["a"][0].set()

    async with fleet(("a",), on_result=cut_after_the_first_row) as f:
        await f.dispatcher.run_group("g", examples)
    token = f.dispatcher.ledger.incarnation
    assert states(f.dispatcher.ledger, "g") == [
        [(f"g.0@{token}", 0, "sealed")],
        [(f"g.1@{token}", 0, "sealed")],  # not lost: the same attempt's row came through
    ]
    runner = f.runners["a"]
    assert (len(runner.started), len(runner.completed), len(runner.cancelled)) == (2, 2, 0)
    assert f.hosts["a"].services.keyed.reattached_total == 1
    expected = await uninterrupted(examples[1])
    assert consumed[1].result["booked"] == expected["booked"]


async def test_a_sibling_that_keeps_losing_fails_its_group_after_max_losses(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet(("a",), dispatch=DispatchSettings(max_losses=2)) as f:

        async def cut_every_connection() -> None:
            while True:
                for cut in f.cuts["a"]:
                    cut.set()
                await trio.sleep(1)

        f.nursery.start_soon(cut_every_connection)
        with pytest.raises(GroupFailed, match="lost its row 2 times"):
            await f.dispatcher.run_group("g", [calendar(1, think_s=10)])
        f.nursery.cancel_scope.cancel()


async def test_a_dropped_group_is_retired_by_the_next_checkpoint_before_prepare(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Any
) -> None:
    async with fleet(("a",)) as f:
        with trio.move_on_after(3):  # the trainer gives the group up mid-episode
            await f.dispatcher.run_group("g", [calendar(1, think_s=100)])
        ledger = f.dispatcher.ledger
        (attempt,) = ledger.groups["g"].siblings[0].attempts
        assert attempt.state is AttemptState.ABANDONED
        assert f.dispatcher.to_retire["a"] == {(attempt.rollout_id, 0)}
        manifest = await f.coordinator.checkpoint(tmp_path / "c1")
        status = f.hosts["a"].services.checkpoints.status()
    assert f.dispatcher.to_retire["a"] == set()  # retired, so forgotten here
    assert status.counts.retired == 1 and status.phase == "idle"
    assert manifest.hosts[0].episodes == []


async def test_a_restored_attempt_is_refused_on_another_host(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet() as f:
        ledger = f.dispatcher.ledger
        async with ledger.mutation():
            ledger.add_group("g", ["a"])
            ledger.dispatch(f"g.0@{ledger.incarnation}", "a")
            restored = ledger.next_attempt(f"g.0@{ledger.incarnation}")
            with pytest.raises(LedgerError, match="belongs to host 'a', not 'b'"):
                ledger.dispatch(restored.capture_key, "b")
            assert ledger.dispatch(restored.capture_key, "a").state is AttemptState.DISPATCHED


async def test_a_stream_deadline_stands_still_while_a_holder_pauses_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet(("a",), client=ClientSettings(request_deadline_s=20)) as f:
        client: RolloutClient = f.dispatcher.hosts["a"].client
        deadlines = f.dispatcher.deadlines
        rows = []

        async def hold() -> None:
            await trio.sleep(5)
            deadlines.pause("checkpoint")
            await trio.sleep(45)  # the episode (30 s) ends inside the pause
            deadlines.release("checkpoint")

        f.nursery.start_soon(hold)
        async with client.stream([calendar(1, think_s=10)]) as stream:
            rows = [row async for row in stream]
    assert [row.ok for row in rows] == [True]  # 30 s of episode against a 20 s deadline


async def die_while_running(f: Any, group: list[dict[str, Any]]) -> None:
    """The fleet's trainer sends group "g", then dies; its host keeps running it."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(f.dispatcher.run_group, "g", group)
        await trio.sleep(1)
        crash(f)
        nursery.cancel_scope.cancel()
    restart(f)


async def test_a_fresh_trainer_after_a_crash_mints_ids_of_its_own(
    autojump_clock: trio.abc.Clock,
) -> None:
    group = [calendar(1, think_s=100)]
    async with fleet(("a",)) as f:
        await die_while_running(f, group)
        consumed: list[SealedResult] = []
        fresh = Dispatcher(list(f.dispatcher.hosts.values()), consumed.append)
        async with fresh:
            await fresh.run_group("g", group)
    assert [sealed.error for sealed in consumed] == [None]
    assert consumed[0].rollout_id != f.dispatcher.ledger.groups["g"].siblings[0].current.rollout_id
    assert states(fresh.ledger, "g")[0][0][2] == "sealed"  # first time: no collision, no loss


async def test_an_identity_a_host_still_runs_is_a_loss_not_a_result(
    autojump_clock: trio.abc.Clock,
) -> None:
    group = [calendar(1, think_s=100)]
    async with fleet(("a",)) as f:
        await die_while_running(f, group)  # the host keeps running g.0@<incarnation>
        consumed: list[SealedResult] = []
        same = Ledger(incarnation=f.dispatcher.ledger.incarnation)  # as a checkpoint had it
        again = Dispatcher(list(f.dispatcher.hosts.values()), consumed.append, ledger=same)
        async with again:
            await again.run_group("g", group)
        status = f.hosts["a"].services.checkpoints.status()
    token = same.incarnation
    assert [sealed.error for sealed in consumed] == [None]
    assert states(same, "g") == [
        [(f"g.0@{token}", 0, "abandoned"), (f"g.0@{token}.g1", 0, "sealed")]
    ]
    assert status.counts.retired == 1  # the other copy was retired (cancelled)
    assert len(f.runners["a"].cancelled) == 1


async def test_a_request_whose_answer_never_came_is_not_resent_under_the_same_id(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet(("a",), client=ClientSettings(request_deadline_s=30)) as f:
        f.mutes["a"].append(True)  # a proxy holds the first answer: its head never comes
        await f.dispatcher.run_group("g", [calendar(1, think_s=5)])
    token = f.dispatcher.ledger.incarnation
    assert states(f.dispatcher.ledger, "g") == [
        [(f"g.0@{token}", 0, "abandoned"), (f"g.0@{token}.g1", 0, "sealed")]
    ]
    # The request, the probe of /health its failure asked for, the fresh attempt: the first
    # request was never re-sent under its id.
    assert len(f.cuts["a"]) == 3
    first, _, fresh = f.opened["a"]
    assert fresh - first == 30 + DispatchSettings().resend_backoff_s  # deadline, then a pause


class StubbornRunner(ExampleRunner):
    """The example environment, slow to stop: a cancelled episode takes 100 s to wind down."""

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        try:
            return await super().run_example(example, context)
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await trio.sleep(100)
            raise


async def test_a_retire_whose_copies_are_still_stopping_stays_queued(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Any
) -> None:
    consumed: list[SealedResult] = []

    def cut_after_the_first_row(sealed: SealedResult) -> None:
        consumed.append(sealed)
        f.cuts["a"][0].set()

    settings = DispatchSettings(control_timeout_s=5)
    examples = [calendar(1, think_s=1.0), calendar(2, think_s=50.0)]
    async with fleet(
        ("a",),
        client=NO_REATTACH,
        dispatch=settings,
        on_result=cut_after_the_first_row,
        runners={"a": StubbornRunner()},
    ) as f:
        await f.dispatcher.run_group("g", examples)
        lost = f.dispatcher.ledger.groups["g"].siblings[1].attempts[0]
        assert f.dispatcher.to_retire["a"] == {(lost.rollout_id, 0)}  # marked, not yet stopped
        await trio.sleep(200)
        await f.coordinator.checkpoint(tmp_path / "c1")  # retires it again, first: done now
        assert f.dispatcher.to_retire["a"] == set()
    assert [sealed.error for sealed in consumed] == [None, None]


async def test_a_stale_row_is_settled_at_once_so_a_checkpoint_does_not_wait_for_it(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Any
) -> None:
    async with fleet(("a",)) as f:
        await die_while_running(f, [calendar(1, think_s=100)])  # g.0 still runs on a
        same = Ledger(incarnation=f.dispatcher.ledger.incarnation)
        again = Dispatcher(list(f.dispatcher.hosts.values()), lambda sealed: None, ledger=same)
        coordinator = CheckpointCoordinator(again, settings=CheckpointSettings(drain_timeout_s=30))
        async with again, trio.open_nursery() as nursery:
            # g.0 is refused stale_attempt; g.1 runs on in the same stream, parked by the
            # checkpoint, so that stream cannot end before the checkpoint does.
            group = [calendar(1, think_s=100), calendar(2, think_s=10)]
            nursery.start_soon(partial(again.run_group, "g", group, hosts=["a", "a"]))
            await trio.sleep(5)
            manifest = await coordinator.checkpoint(tmp_path / "c1")
            nursery.cancel_scope.cancel()
    assert manifest.hosts[0].episodes == [f"g.1@{same.incarnation}"]


async def test_a_dropped_group_id_is_not_run_again(autojump_clock: trio.abc.Clock) -> None:
    async with fleet(("a",)) as f:
        with trio.move_on_after(3):
            await f.dispatcher.run_group("g", [calendar(1, think_s=100)])
        with pytest.raises(ValueError, match="'g' was given up"):
            await f.dispatcher.run_group("g", [calendar(1, think_s=100)])


async def test_a_request_too_large_to_send_fails_its_group_at_once_naming_the_cause(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet(("a",), client=ClientSettings(max_request_bytes=100)) as f:
        start = trio.current_time()
        with pytest.raises(GroupFailed, match="lower the chunk size"):
            await f.dispatcher.run_group("g", [calendar(1), calendar(2)])
        assert trio.current_time() == start  # at once: no re-send could ever fit
    assert f.opened["a"] == []  # nothing was sent, and nothing is retired or re-sent
    assert f.dispatcher.to_retire["a"] == set()
