"""The recovery ledger: its state table, its barrier, and its strict persistence."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing

from trio_gym.trainer.ledger import AttemptState, Ledger, LedgerError

A, B = "http://host-a:8080", "http://host-b:8080"


async def two_siblings() -> Ledger:
    ledger = Ledger()
    async with ledger.mutation():
        ledger.add_group("g1", [A, B])
    return ledger


async def test_an_attempt_is_reserved_then_dispatched_then_sealed() -> None:
    ledger = await two_siblings()
    async with ledger.mutation():
        ledger.move("g1.0", AttemptState.DISPATCHED)
        ledger.move("g1.0", AttemptState.SEALED)
    assert ledger.attempt("g1.0").state is AttemptState.SEALED
    assert [a.capture_key for a in ledger.in_state(AttemptState.RESERVED)] == ["g1.1"]
    assert ledger.attempt("g1.1").host == B


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ([], AttemptState.SEALED),  # sealed without a dispatch
        ([AttemptState.DISPATCHED, AttemptState.SEALED], AttemptState.DISPATCHED),  # sent twice
        ([AttemptState.ABANDONED], AttemptState.DISPATCHED),  # an abandoned attempt sent
    ],
    ids=["seal-reserved", "dispatch-sealed", "dispatch-abandoned"],
)
async def test_moves_the_table_does_not_allow_are_refused(
    path: list[AttemptState], illegal: AttemptState
) -> None:
    ledger = await two_siblings()
    async with ledger.mutation():
        for state in path:
            ledger.move("g1.0", state)
        with pytest.raises(LedgerError, match="illegal move"):
            ledger.move("g1.0", illegal)


async def test_an_admission_refusal_returns_the_attempt_with_its_identity() -> None:
    ledger = await two_siblings()
    async with ledger.mutation():
        ledger.move("g1.0", AttemptState.DISPATCHED)
        refused = ledger.move("g1.0", AttemptState.RESERVED)
    assert (refused.rollout_id, refused.number, refused.capture_key) == ("g1.0", 0, "g1.0")
    assert len(ledger.sibling_of("g1.0").attempts) == 1  # no attempt spent


async def test_a_retry_is_a_fresh_attempt_under_a_new_rollout_id() -> None:
    ledger = await two_siblings()
    async with ledger.mutation():
        ledger.move("g1.0", AttemptState.DISPATCHED)
        ledger.move("g1.0", AttemptState.ABANDONED)
        fresh = ledger.retry("g1.0")
        with pytest.raises(LedgerError, match="current"):
            ledger.move("g1.0", AttemptState.RESERVED)  # the old attempt is history
    assert (fresh.rollout_id, fresh.number, fresh.state) == ("g1.0.g1", 0, AttemptState.RESERVED)
    assert [a.capture_key for a in ledger.sibling_of("g1.0").attempts] == ["g1.0", "g1.0.g1"]


async def test_a_restored_episode_continues_as_the_next_attempt_on_its_host() -> None:
    ledger = await two_siblings()
    async with ledger.mutation():
        ledger.move("g1.1", AttemptState.DISPATCHED)
        after = ledger.next_attempt("g1.1")
    assert (after.rollout_id, after.number, after.capture_key, after.host) == (
        "g1.1",
        1,
        "g1.1-a1",
        B,
    )
    assert ledger.sibling_of("g1.1-a1").current is after


async def test_changes_outside_a_mutation_are_refused() -> None:
    ledger = await two_siblings()
    with pytest.raises(LedgerError, match="inside"):
        ledger.move("g1.0", AttemptState.DISPATCHED)
    with pytest.raises(LedgerError, match="inside"):
        ledger.add_group("g2", [A])


async def test_a_waiter_wakes_at_the_next_mutation_and_not_before(
    autojump_clock: trio.abc.Clock,
) -> None:
    ledger = await two_siblings()
    cursor = ledger.mutations
    woke: list[tuple[float, int]] = []

    async def waiter() -> None:
        after = await ledger.wait_for_mutation(cursor)
        woke.append((trio.current_time(), after))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(100.123)  # nothing changes meanwhile
        assert woke == []
        async with ledger.mutation():
            ledger.move("g1.0", AttemptState.DISPATCHED)
    # Woken by the mutation itself, at its very instant: a poller would come a tick later.
    assert woke == [(100.123, cursor + 1)]


async def test_a_checkpoint_holding_the_ledger_sees_no_change_until_it_lets_go(
    autojump_clock: trio.abc.Clock,
) -> None:
    ledger = await two_siblings()
    async with trio.open_nursery() as nursery, ledger.mutation():
        nursery.start_soon(_dispatch, ledger, "g1.0")
        await trio.sleep(10)
        assert ledger.attempt("g1.0").state is AttemptState.RESERVED  # a consistent cut
    assert ledger.attempt("g1.0").state is AttemptState.DISPATCHED


async def _dispatch(ledger: Ledger, key: str) -> None:
    async with ledger.mutation():
        ledger.move(key, AttemptState.DISPATCHED)


async def test_the_ledger_round_trips_through_json() -> None:
    ledger = await two_siblings()
    async with ledger.mutation():
        ledger.move("g1.0", AttemptState.DISPATCHED)
        ledger.move("g1.0", AttemptState.ABANDONED)
        ledger.retry("g1.0", host=B)
        ledger.move("g1.1", AttemptState.DISPATCHED)
        ledger.next_attempt("g1.1")
    document = json.loads(json.dumps(ledger.to_json()))
    again = Ledger.from_json(document)
    assert again.to_json() == document
    assert again.attempt("g1.0.g1").host == B and again.sibling_of("g1.0").generation == 1
    assert again.attempt("g1.1-a1").state is AttemptState.RESERVED


def _saved(change: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "version": 1,
        "groups": [
            {
                "group_id": "g1",
                "siblings": [
                    {
                        "index": 0,
                        "attempts": [
                            {"rollout_id": "g1.0", "attempt": 0, "host": A, "state": "sealed"}
                        ],
                    }
                ],
            }
        ],
    }
    change(document)
    return document


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["groups"][0]["siblings"][0]["attempts"][0].update(colour="red"), "colour"),
        (lambda d: d["groups"][0]["siblings"][0]["attempts"][0].update(state="lost"), "state"),
        (lambda d: d["groups"][0]["siblings"][0]["attempts"][0].update(attempt="0"), "attempt"),
        (lambda d: d["groups"].append(d["groups"][0]), "twice"),
        (
            lambda d: d["groups"].append({**d["groups"][0], "group_id": "g2"}),
            "episode g1.0 is already in the ledger",
        ),
    ],
    ids=["version", "unknown-field", "unknown-attempt-field", "state", "type", "group", "episode"],
)
def test_a_ledger_that_is_not_exactly_ours_is_refused_with_the_reason(
    change: Any, reason: str
) -> None:
    Ledger.from_json(_saved(lambda d: None))  # the unchanged document loads
    with pytest.raises(LedgerError, match=reason):
        Ledger.from_json(_saved(change))
