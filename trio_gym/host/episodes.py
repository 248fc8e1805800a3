"""Episodes: their identity, admission, and what happens at their step boundaries.

Every example the host runs is an *episode* with a rollout id (``_ng_rollout_id``, else
``"{_ng_task_index}-{_ng_rollout_index}"``, else one assigned here) and an attempt
(``_ng_attempt_index``, default 0). Its *capture key* is the rollout id, with ``-a<N>`` appended
for attempt N > 0: the name it has in checkpoints.

The registry admits episodes one at a time, synchronously (so admission and registration are one
step): a capture key already running, a retired attempt, or an attempt older than a restored
one is ``stale_attempt``; while admission is closed (a checkpoint), a new episode is
``admission_closed``, but a restored episode's own re-dispatch is admitted. It also implements
the runner's :class:`~trio_gym.runners.base.EpisodeHooks`: at a boundary an episode records its
state and, while a checkpoint wants episodes parked, waits there; a ``replay`` step is run in a
cancel scope that a checkpoint may cancel. Whether admission is open and whether episodes park
is the checkpoint phase's to say (:mod:`~trio_gym.host.checkpoint_phases`); the registry
follows its moves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs
import trio

from trio_gym.changes import Changes
from trio_gym.deadline import PausableDeadline
from trio_gym.errors import ErrorCode, WireError
from trio_gym.protocol.identity import EpisodeId
from trio_gym.runners.base import ExampleContext, StepInterrupted, StepMode

from .checkpoint_phases import CheckpointPhases, Conduct

T = TypeVar("T")


@attrs.define(eq=False)
class LiveEpisode:
    """An episode being run (or parked) in this process."""

    id: EpisodeId
    batch_id: str
    index: int
    batch_deadline: PausableDeadline
    """Its batch's: paused while the episode is parked (time parked is not charged)."""
    restored: RestoredEpisode | None = None
    started: bool = False
    """True once its runner was called: only then is a restored episode used up."""
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    """Cancelled by ``retire``; the episode then ends as ``stale_attempt``."""
    step: int | None = None
    state: Mapping[str, Any] | None = None
    parked: bool = False
    replay_scope: trio.CancelScope | None = None

    @property
    def reported_a_boundary(self) -> bool:
        return self.step is not None


@attrs.frozen
class RestoredEpisode:
    """An episode installed from an export, waiting for its one re-dispatch."""

    id: EpisodeId
    step: int
    state: Mapping[str, Any]


class Episodes:
    """Every episode this host knows: running, parked, restored, retired.

    All changes are synchronous; waiters sleep on :meth:`wait_for_change` and are woken by
    every change, never by polling. It owns the checkpoint phases, and follows their moves.
    """

    def __init__(self, *, runner_reports_boundaries: Callable[[], bool]) -> None:
        self.phases = CheckpointPhases(on_move=self._phase_moved)
        self.live: dict[str, LiveEpisode] = {}
        self.restored: dict[str, RestoredEpisode] = {}
        self.retired: dict[str, int] = {}
        """Rollout id -> the highest attempt refused until ``forget``."""
        self.superseded: dict[str, int] = {}
        """Rollout id -> the attempt a restore installed; older attempts are stale."""
        self.consumed: dict[str, str] = {}
        """Capture key -> rollout id of restored episodes already re-dispatched (exactly once)."""
        self.boundaries = 0
        self.restored_total = 0
        """Episodes a restore installed, over the host's life."""
        self._release = Changes()
        """Noted when parking ends: parked episodes go on."""
        self._changes = Changes()
        self._reports_boundaries = runner_reports_boundaries
        self._paused: set[PausableDeadline] = set()
        """The deadlines of batches an episode of which parked, run on when parking ends."""

    @property
    def admission_open(self) -> bool:
        return self.phases.conduct.admission_open

    @property
    def parking(self) -> bool:
        return self.phases.conduct.parking

    # --- changes and waiting ------------------------------------------------------------

    def _note(self) -> None:
        self._changes.note()

    async def wait_for_change(self) -> None:
        await self._changes.wait()

    # --- admission ------------------------------------------------------------------------

    def refusal(self, episode: EpisodeId) -> WireError | None:
        """Why ``episode`` may not start now, or ``None`` (it may)."""
        key = episode.capture_key
        if key in self.live:
            return _stale(f"{key} is already running on this host")
        retired = self.retired.get(episode.rollout_id)
        if retired is not None and episode.attempt <= retired:
            return _stale(
                f"rollout {episode.rollout_id} was retired up to attempt {retired}; "
                f"send a later attempt (this one is {episode.attempt})"
            )
        if key in self.consumed:
            return _stale(f"the restored episode {key} was already dispatched once")
        current = self.superseded.get(episode.rollout_id)
        if current is not None and episode.attempt < current:
            return _stale(
                f"rollout {episode.rollout_id} was restored as attempt {current}; "
                f"attempt {episode.attempt} is stale"
            )
        if key in self.restored and not self.parking:
            return None  # a restored episode's own re-dispatch passes a restore's closed gate
        if not self.admission_open:
            return WireError(
                ErrorCode.ADMISSION_CLOSED,
                "a checkpoint is in progress and new episodes wait until it ends; retry after "
                "Retry-After seconds (no attempt is spent)",
                headers=[("retry-after", "1")],
            )
        return None

    def admit_or_refuse(
        self, episode: EpisodeId, batch_id: str, index: int, batch_deadline: PausableDeadline
    ) -> LiveEpisode | WireError:
        """Admit ``episode`` now, or say why not; one synchronous step."""
        refusal = self.refusal(episode)
        if refusal is not None:
            return refusal
        return self.admit(episode, batch_id, index, batch_deadline)

    def admit(
        self, episode: EpisodeId, batch_id: str, index: int, batch_deadline: PausableDeadline
    ) -> LiveEpisode:
        """Register an episode that :meth:`refusal` allowed; synchronous with that check."""
        restored = self.restored.pop(episode.capture_key, None)
        if restored is not None:
            self.consumed[episode.capture_key] = episode.rollout_id
        live = LiveEpisode(episode, batch_id, index, batch_deadline, restored=restored)
        self.live[episode.capture_key] = live
        self._note()
        return live

    def end(self, live: LiveEpisode) -> None:
        """The episode is over (or never ran). A restored episode whose runner never started —
        its batch was refused, or its caller left first — goes back to wait for a dispatch."""
        if self.live.get(live.id.capture_key) is not live:
            return
        del self.live[live.id.capture_key]
        if live.restored is not None and not live.started:
            self.consumed.pop(live.id.capture_key, None)
            self.restored[live.id.capture_key] = live.restored
        self._note()

    # --- the runner's hooks -----------------------------------------------------------------

    async def boundary(self, context: ExampleContext, step: int, state: Mapping[str, Any]) -> None:
        live = self.live[context.capture_key]
        live.step, live.state = step, state
        self.boundaries += 1
        while self.parking:
            if not live.parked:
                live.parked = True
                live.batch_deadline.pause()
                self._paused.add(live.batch_deadline)
                self._note()
            await self._release.wait()
        if live.parked:
            live.parked = False
            self._note()
        await trio.lowlevel.checkpoint()

    async def run_step(
        self, context: ExampleContext, step: Callable[[], Awaitable[T]], mode: StepMode
    ) -> T:
        if mode == "wait":
            return await step()
        live = self.live[context.capture_key]
        if self.parking:
            raise StepInterrupted("a checkpoint is parking episodes")
        with trio.CancelScope() as scope:
            live.replay_scope = scope
            try:
                return await step()
            finally:
                live.replay_scope = None
        raise StepInterrupted("a checkpoint cut this replay step short")

    # --- what checkpoints do ----------------------------------------------------------------

    def _phase_moved(self, before: Conduct, after: Conduct) -> None:
        """Parking begins: cut replay steps short (their episodes park at the boundary before
        them). Parking ends: let parked episodes and their batches' deadlines go on (a batch
        whose parked episode ended meanwhile too). Either way, waiters look again."""
        if after.parking and not before.parking:
            for live in self.live.values():
                if live.replay_scope is not None:
                    live.replay_scope.cancel()
        if before.parking and not after.parking:
            for deadline in self._paused:
                deadline.resume()
            self._paused.clear()
            self._release.note()
        self._note()

    def blockers(self) -> list[LiveEpisode]:
        """Capturable episodes not yet parked: what ``prepare`` waits for. An episode is
        capturable once it reported a boundary, or from the start if its runner promises one."""
        every = self._reports_boundaries()  # asked once per listing, not once per episode
        return [
            live
            for live in self.live.values()
            if not live.parked and (every or live.reported_a_boundary)
        ]

    def restarts(self) -> list[LiveEpisode]:
        """Episodes that cannot be captured: listed, never waited for, never exported."""
        if self._reports_boundaries():
            return []
        return [live for live in self.live.values() if not live.reported_a_boundary]

    def parked(self) -> list[LiveEpisode]:
        return [live for live in self.live.values() if live.parked]

    def knows(self, capture_key: str) -> bool:
        """Whether ``capture_key`` is running, waiting as restored, or was restored and used."""
        return (
            capture_key in self.live or capture_key in self.restored or capture_key in self.consumed
        )

    def install(self, restored: Iterable[RestoredEpisode]) -> None:
        for episode in restored:
            self.restored[episode.id.capture_key] = episode
            self.restored_total += 1
            self.superseded[episode.id.rollout_id] = episode.id.attempt
        self._note()

    def retire(self, rollout_id: str, attempt: int) -> tuple[list[LiveEpisode], list[str]]:
        """Refuse ``rollout_id`` up to ``attempt``; cancel its live episodes, drop restored ones.

        Returns the cancelled live episodes (to wait for) and the dropped restored capture keys.
        """
        self.retired[rollout_id] = max(attempt, self.retired.get(rollout_id, -1))
        cancelled = [
            live
            for live in self.live.values()
            if live.id.rollout_id == rollout_id and live.id.attempt <= attempt
        ]
        for live in cancelled:
            live.scope.cancel()
        dropped = [
            key
            for key, episode in self.restored.items()
            if episode.id.rollout_id == rollout_id and episode.id.attempt <= attempt
        ]
        for key in dropped:
            del self.restored[key]
        self._note()
        return cancelled, dropped

    def forget(self, rollout_ids: Iterable[str] | None) -> int:
        """Drop retirement marks, and what restores remembered of those rollouts (bounded
        memory); returns how many retirement marks were dropped."""
        if rollout_ids is None:
            count = len(self.retired)
            self.retired.clear()
            self.superseded.clear()
            self.consumed.clear()
        else:
            ids = set(rollout_ids)
            count = sum(1 for rid in ids if self.retired.pop(rid, None) is not None)
            for rid in ids:
                self.superseded.pop(rid, None)
            self.consumed = {key: rid for key, rid in self.consumed.items() if rid not in ids}
        self._note()
        return count


def _stale(message: str) -> WireError:
    return WireError(ErrorCode.STALE_ATTEMPT, message)
