"""The embedded example environment: deterministic, step by step, capturable, verified."""

from __future__ import annotations

import json

import attrs
import pytest
import trio

from trio_gym.runners import ExampleContext, ExampleRunner
from trio_gym.runners.example import (
    DAY_END,
    CalendarStore,
    EnvironmentFault,
    EpisodeState,
    Event,
    ExampleTask,
    advance,
    result_of,
    verify,
)


async def run(example: dict[str, object]) -> dict[str, object]:
    runner = ExampleRunner()
    result = await runner.run_example(example, ExampleContext(batch_id="t", index=0))
    assert len(runner.store) == 0  # the episode's calendar is freed when it ends
    return result  # type: ignore[no-any-return]


async def test_same_seed_same_episode_and_rewards_vary_across_seeds() -> None:
    first = [await run({"seed": seed, "meetings": 5}) for seed in range(20)]
    again = [await run({"seed": seed, "meetings": 5}) for seed in range(20)]
    assert first == again
    rewards = {result["reward"] for result in first}
    assert len(rewards) > 2 and 1.0 in rewards  # not a constant, and sometimes perfect
    assert all(result["steps"] == 5 for result in first)


async def test_think_time_is_spent_before_every_step(autojump_clock: trio.abc.Clock) -> None:
    start = trio.current_time()
    await run({"seed": 1, "meetings": 4, "think_s": 7.5})
    assert trio.current_time() - start == 30


def test_an_episode_captured_at_any_step_boundary_continues_to_the_same_result() -> None:
    task = ExampleTask(seed=11, meetings=6)
    store = CalendarStore()
    store.open("whole")
    state = EpisodeState.begin(task)
    while not state.done:
        state = advance(state, store, "whole")
    uninterrupted = result_of(state, store.events("whole"))

    for boundary in range(task.meetings + 1):
        store = CalendarStore()
        store.open("a")
        state = EpisodeState.begin(task)
        for _ in range(boundary):
            state = advance(state, store, "a")
        # Capture the state and the episode's part of the store as JSON; restore elsewhere.
        captured = json.dumps(
            {"state": state.to_json(), "events": [attrs.asdict(e) for e in store.events("a")]}
        )
        snapshot = json.loads(captured)
        restored_store = CalendarStore()
        restored_store.open("b", [Event(**event) for event in snapshot["events"]])
        restored = EpisodeState.from_json(snapshot["state"])
        assert restored == state
        while not restored.done:
            restored = advance(restored, restored_store, "b")
        assert result_of(restored, restored_store.events("b")) == uninterrupted, boundary


def test_the_reward_is_verified_from_the_store_not_the_policy() -> None:
    task = ExampleTask(seed=4, meetings=3)
    store = CalendarStore()
    store.open("k")
    state = EpisodeState.begin(task)
    while not state.done:
        state = advance(state, store, "k")
    events = store.events("k")
    assert verify(state, events) == 1.0
    first = events[0]
    # A second booking of the same request, a wrong length, and a slot past the morning are
    # each caught, whatever the policy believes it did.
    assert verify(state, [*events, first]) < 1.0
    assert (
        verify(state, [Event(first.request, first.title, first.start, first.end + 15), *events[1:]])
        < 1.0
    )
    late = Event(first.request, first.title, DAY_END, DAY_END + first.end - first.start)
    assert verify(state, [late, *events[1:]]) < 1.0
    assert verify(state, events[1:]) == pytest.approx(2 / 3)


async def test_a_scripted_fault_raises_at_its_step() -> None:
    with pytest.raises(EnvironmentFault, match="step 2"):
        await run({"seed": 1, "meetings": 4, "fail_at_step": 2})


@pytest.mark.parametrize(
    ("example", "fragment"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"meetings": 0}, "meetings"),
        ({"meetings": 13}, "meetings"),
        ({"think_s": -0.5}, "think_s"),
        ({"think": 1}, "unknown key 'think'"),
    ],
)
def test_malformed_examples_are_refused_naming_the_key(
    example: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        ExampleRunner().check_example(example)


def test_trainer_keys_starting_with_underscore_are_carried_not_refused() -> None:
    ExampleRunner().check_example({"seed": 1, "_ng_task_index": 3, "_anything": {"x": 1}})
