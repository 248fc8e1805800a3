"""The host's checkpoint phases: the table of legal moves, and what each phase lets episodes do."""

from __future__ import annotations

import pytest

from trio_gym.host.checkpoint_phases import CONDUCT, TRANSITIONS, CheckpointPhases
from trio_gym.host.episodes import Episodes
from trio_gym.protocol.control import CheckpointPhase

# A legal way from idle to each phase.
ROUTES = {
    CheckpointPhase.IDLE: [],
    CheckpointPhase.PREPARING: [CheckpointPhase.PREPARING],
    CheckpointPhase.PREPARED: [CheckpointPhase.PREPARING, CheckpointPhase.PREPARED],
    CheckpointPhase.COMMITTED: [
        CheckpointPhase.PREPARING,
        CheckpointPhase.PREPARED,
        CheckpointPhase.COMMITTED,
    ],
    CheckpointPhase.RESTORED: [CheckpointPhase.RESTORED],
}


def phases_at(phase: CheckpointPhase) -> tuple[CheckpointPhases, Episodes]:
    episodes = Episodes(runner_reports_boundaries=lambda: True)
    phases = episodes.phases
    for step in ROUTES[phase]:
        phases.move(step, "c1")
    return phases, episodes


@pytest.mark.parametrize("start", list(CheckpointPhase))
@pytest.mark.parametrize("to", list(CheckpointPhase))
def test_only_the_tables_moves_are_made(start: CheckpointPhase, to: CheckpointPhase) -> None:
    phases, episodes = phases_at(start)
    if to in TRANSITIONS[start]:
        phases.move(to, "c1")
        assert phases.phase is to
        assert phases.checkpoint_id == (None if to is CheckpointPhase.IDLE else "c1")
    else:
        with pytest.raises(RuntimeError, match=f"illegal move {start} -> {to}"):
            phases.move(to, "c1")
        assert phases.phase is start  # nothing moved


@pytest.mark.parametrize("phase", list(CheckpointPhase))
def test_the_phase_alone_opens_admission_and_parks_episodes(phase: CheckpointPhase) -> None:
    _, episodes = phases_at(phase)
    assert episodes.admission_open is (phase is CheckpointPhase.IDLE)
    parking = phase in (
        CheckpointPhase.PREPARING,
        CheckpointPhase.PREPARED,
        CheckpointPhase.COMMITTED,
    )
    assert episodes.parking is parking
    assert CONDUCT[phase].parking is parking
