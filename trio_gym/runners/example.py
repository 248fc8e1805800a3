"""The embedded example environment: a calendar assistant with a scripted policy.

It needs no model, no network and no install, so a fresh machine can run the host end to end.
Every example is an *episode*: a morning calendar (09:00-13:00) with some busy blocks, and a
list of meeting requests, both derived from the example's ``seed``. Each step the scripted
policy takes the next request and books it in the earliest free 15-minute-aligned slot, or
skips it when nothing fits. Booking is a side effect in the environment's own calendar store.
At the end the environment *verifies* the store — not the policy's own account — and the reward
is the fraction of requests booked exactly once, with the right length, inside the morning,
overlapping nothing.

Step boundaries are explicit: between steps, the whole episode is :class:`EpisodeState` (plain
JSON-able data) plus the episode's events in the store, so an episode can be captured after any
step and continued elsewhere to the same result.

Example fields (keys starting with ``_`` are the trainer's and are ignored):
``seed`` (int >= 0), ``meetings`` (1-12 requests), ``think_s`` (seconds the policy "thinks"
before each step; lets a batch take as long as a real one), ``fail_at_step`` (raise an
environment fault at that step: the failure path, on demand), ``step_mode`` (``wait``, the
default, or ``replay``: a step's only side effect is its booking at the very end, so a
checkpoint may cut the thinking short and the step runs again after restore).

For checkpoints the runner is a state participant: the calendar store is exported and restored
with the episodes (``StateParticipant``), keyed by each episode's capture key.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Final, Literal

import attrs
import pydantic
import trio
from pydantic import BaseModel, ConfigDict, Field

from trio_gym.errors import describe_validation_error
from trio_gym.runners.base import ExampleContext, StepInterrupted

DAY_START: Final = 9 * 60  # minutes after midnight
DAY_END: Final = 13 * 60  # a short morning, so some requests do not fit and rewards vary
GRID_MINUTES: Final = 15
TITLES: Final = ("standup", "design review", "1:1", "planning", "retro", "interview", "demo")
DURATIONS: Final = (15, 30, 45, 60, 90)


class ExampleTask(BaseModel):
    """The example's own fields, validated strictly."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    seed: int = Field(default=0, ge=0)
    meetings: int = Field(default=3, ge=1, le=12)
    think_s: float = Field(default=0.0, ge=0, le=3600, allow_inf_nan=False)
    fail_at_step: int | None = Field(default=None, ge=0)
    step_mode: Literal["wait", "replay"] = "wait"

    @classmethod
    def from_example(cls, example: Mapping[str, Any]) -> ExampleTask:
        """Validate ``example``; raises ``ValueError`` naming each bad key."""
        own = {key: value for key, value in example.items() if not key.startswith("_")}
        try:
            return cls.model_validate(own)
        except pydantic.ValidationError as exc:
            raise ValueError(describe_validation_error(exc)) from exc


class EnvironmentFault(Exception):
    """A failure inside the environment (here: the scripted one of ``fail_at_step``)."""


@attrs.frozen
class Meeting:
    title: str
    minutes: int


@attrs.frozen
class Event:
    """A booked meeting as the calendar store holds it."""

    request: int
    title: str
    start: int
    end: int

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


def generate(seed: int, meetings: int) -> tuple[list[tuple[int, int]], list[Meeting]]:
    """The busy blocks and meeting requests of episode ``seed``; the same seed, the same day."""
    rng = random.Random(seed)
    busy = []
    for _ in range(rng.randint(1, 3)):
        start = DAY_START + GRID_MINUTES * rng.randrange((DAY_END - DAY_START) // GRID_MINUTES)
        busy.append((start, min(DAY_END, start + rng.choice(DURATIONS))))
    requests = [Meeting(rng.choice(TITLES), rng.choice(DURATIONS)) for _ in range(meetings)]
    return sorted(busy), requests


class CalendarStore:
    """The environment's side-effect store: each episode's calendar, by episode key."""

    def __init__(self) -> None:
        self._calendars: dict[str, list[Event]] = {}

    def open(self, key: str, events: list[Event] | None = None) -> None:
        if key in self._calendars:
            raise KeyError(f"episode {key!r} already has a calendar")
        self._calendars[key] = list(events or [])

    def create_event(self, key: str, event: Event) -> None:
        """The side effect of one step."""
        self._calendars[key].append(event)

    def events(self, key: str) -> list[Event]:
        return list(self._calendars[key])

    def close(self, key: str) -> None:
        self._calendars.pop(key, None)

    def __len__(self) -> int:
        return len(self._calendars)


@attrs.frozen
class EpisodeState:
    """Everything the policy knows between two steps; JSON-able through :meth:`to_json`."""

    task: ExampleTask
    busy: tuple[tuple[int, int], ...]
    requests: tuple[Meeting, ...]
    step: int = 0
    skipped: tuple[int, ...] = ()

    @classmethod
    def begin(cls, task: ExampleTask) -> EpisodeState:
        busy, requests = generate(task.seed, task.meetings)
        return cls(task, tuple(busy), tuple(requests))

    @property
    def done(self) -> bool:
        return self.step == len(self.requests)

    def to_json(self) -> dict[str, Any]:
        return {
            "task": self.task.model_dump(),
            "busy": [list(block) for block in self.busy],
            "requests": [attrs.asdict(meeting) for meeting in self.requests],
            "step": self.step,
            "skipped": list(self.skipped),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EpisodeState:
        return cls(
            task=ExampleTask.model_validate(data["task"]),
            busy=tuple((int(start), int(end)) for start, end in data["busy"]),
            requests=tuple(Meeting(**meeting) for meeting in data["requests"]),
            step=int(data["step"]),
            skipped=tuple(int(index) for index in data["skipped"]),
        )


def choose_slot(state: EpisodeState, booked: list[Event], minutes: int) -> int | None:
    """The scripted policy: the earliest grid-aligned start where ``minutes`` fit, or None."""
    for start in range(DAY_START, DAY_END - minutes + 1, GRID_MINUTES):
        end = start + minutes
        clashes_busy = any(b_start < end and start < b_end for b_start, b_end in state.busy)
        if not clashes_busy and not any(event.overlaps(start, end) for event in booked):
            return start
    return None


def advance(state: EpisodeState, store: CalendarStore, key: str) -> EpisodeState:
    """Take one step: book (a side effect in ``store``) or skip the next request."""
    if state.task.fail_at_step == state.step:
        raise EnvironmentFault(f"scripted environment fault at step {state.step}")
    meeting = state.requests[state.step]
    start = choose_slot(state, store.events(key), meeting.minutes)
    if start is None:
        return attrs.evolve(state, step=state.step + 1, skipped=(*state.skipped, state.step))
    store.create_event(key, Event(state.step, meeting.title, start, start + meeting.minutes))
    return attrs.evolve(state, step=state.step + 1)


def verify(state: EpisodeState, events: list[Event]) -> float:
    """The environment's reward, from its own store: the share of requests booked correctly."""
    correct = 0
    for index, meeting in enumerate(state.requests):
        mine = [event for event in events if event.request == index]
        if len(mine) != 1:
            continue
        event = mine[0]
        others = [other for other in events if other is not event]
        if (
            event.title == meeting.title
            and event.end - event.start == meeting.minutes
            and event.start >= DAY_START
            and event.end <= DAY_END
            and not any(
                b_start < event.end and event.start < b_end for b_start, b_end in state.busy
            )
            and not any(other.overlaps(event.start, event.end) for other in others)
        ):
            correct += 1
    return correct / len(state.requests)


def result_of(state: EpisodeState, events: list[Event]) -> dict[str, Any]:
    return {
        "reward": verify(state, events),
        "steps": state.step,
        "seed": state.task.seed,
        "booked": [attrs.asdict(event) for event in events],
        "skipped": [state.requests[index].title for index in state.skipped],
    }


class ExampleRunner:
    """Runs calendar episodes; the default runner. Its store is a checkpoint participant."""

    participant = ("calendar", "side_effect_store")
    reports_boundaries = True

    def __init__(self) -> None:
        self.store = CalendarStore()

    def check_example(self, example: Mapping[str, Any]) -> None:
        ExampleTask.from_example(example)

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        key = context.example_key
        if context.restored is not None:  # its calendar came back with the export
            state = EpisodeState.from_json(context.restored)
        else:
            state = EpisodeState.begin(ExampleTask.from_example(example))
            self.store.open(key)
        try:
            return await self.continue_episode(state, key, context)
        finally:
            self.store.close(key)

    async def continue_episode(
        self, state: EpisodeState, key: str, context: ExampleContext
    ) -> dict[str, Any]:
        """Run ``state`` from its current step boundary to the end; its calendar is in the store.

        Reports every boundary, the first (nothing done yet) and the last (all done) included.
        """
        while True:
            await context.boundary(state.step, state.to_json())
            if state.done:
                return result_of(state, self.store.events(key))
            try:
                state = await context.run_step(
                    partial(self._step, state, key), mode=state.task.step_mode
                )
            except StepInterrupted:
                continue  # cut short before its side effect: back to the boundary

    async def _step(self, state: EpisodeState, key: str) -> EpisodeState:
        await trio.sleep(state.task.think_s)  # the policy thinks
        return advance(state, self.store, key)  # the side effect, at the very end

    # --- StateParticipant ---------------------------------------------------------------

    def export_records(self, capture_keys: Sequence[str]) -> list[dict[str, Any]]:
        return [
            {"capture_key": key, "events": [attrs.asdict(e) for e in self.store.events(key)]}
            for key in capture_keys
        ]

    def restore_records(
        self, records: Sequence[Mapping[str, Any]], renames: Mapping[str, str]
    ) -> None:
        for record in records:
            events = [Event(**event) for event in record["events"]]
            self.store.open(renames[record["capture_key"]], events)

    def discard(self, capture_key: str) -> None:
        self.store.close(capture_key)
