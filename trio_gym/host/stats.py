"""What a host counts: plain numbers bumped where each event happens, read by ``/metrics``
(:mod:`.metrics`), by tests and by log lines. Nothing here costs more than an addition on the
rollout path; the exposition is built only when someone scrapes."""

from __future__ import annotations

import collections
import re
from typing import Final

import attrs

from trio_gym.changes import Changes
from trio_gym.exposition import Histogram
from trio_gym.http import Traffic
from trio_gym.protocol.rollouts import RUNNER_ERROR, STALE_ATTEMPT

# Seconds. An example lasts from a fraction of a second (a verifier) to the longest deadline an
# RL step allows (an hour); a heartbeat is late by milliseconds unless the host is overloaded.
DURATION_BOUNDS_S: Final = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
LATENESS_BOUNDS_S: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# A label value made by someone else (a Gym failure class an environment names) is kept only
# while it looks like a name and few have been seen: a metric's series must stay bounded.
LABEL_PATTERN: Final = re.compile(r"[a-z][a-z0-9_]{0,62}(:[a-z][a-z0-9_]{0,62})?")
MAX_FOREIGN_LABELS: Final = 32
OTHER: Final = "other"
NO_CLASS: Final = ""


@attrs.define
class ForeignLabels:
    """Label values that arrive from outside, bounded (see ``LABEL_PATTERN``); the host's own
    failure classes are among them from the start, so none of them is ever ``other``."""

    seen: set[str] = attrs.field(factory=lambda: {RUNNER_ERROR, STALE_ATTEMPT})

    def bounded(self, value: object) -> str:
        if not isinstance(value, str) or not LABEL_PATTERN.fullmatch(value):
            return OTHER
        if value not in self.seen:
            if len(self.seen) >= MAX_FOREIGN_LABELS:
                return OTHER
            self.seen.add(value)
        return value


@attrs.define
class HostStats:
    """Every example the host starts ends in exactly one of completed, failed or cancelled."""

    connections_open: int = 0
    connections_accepted: int = 0
    connections_refused: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """By reason: ``busy`` (answered 503) or ``dropped`` (the overflow full too)."""
    requests_refused: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """By error code: every refusal answered before a status line (any path)."""
    batches_running: int = 0
    batch_changes: Changes = attrs.field(factory=Changes)
    """Noted when a batch ends."""
    batches_finished: collections.Counter[str] = attrs.field(factory=collections.Counter)
    """By outcome: ``ok``, ``caller_gone``, or the error code it was answered with."""
    examples_started: int = 0
    examples_ended: collections.Counter[tuple[str, str]] = attrs.field(factory=collections.Counter)
    """By (outcome, Gym failure class): the class only for a failed example whose record has one."""
    example_seconds: dict[str, Histogram] = attrs.field(factory=dict)
    """By outcome."""
    heartbeats_sent: int = 0
    heartbeat_lateness: Histogram = attrs.field(factory=lambda: Histogram(LATENESS_BOUNDS_S))
    traffic: Traffic = attrs.field(factory=Traffic)
    """Bytes read from and written to callers."""
    failure_classes: ForeignLabels = attrs.field(factory=ForeignLabels)

    def count_end(self, outcome: str, seconds: float, failure_class: object = None) -> None:
        """Count an example's end: ``completed``, ``failed`` or ``cancelled``, after ``seconds``."""
        label = NO_CLASS if failure_class is None else self.failure_classes.bounded(failure_class)
        self.examples_ended[outcome, label] += 1
        histogram = self.example_seconds.get(outcome)
        if histogram is None:
            histogram = self.example_seconds[outcome] = Histogram(DURATION_BOUNDS_S)
        histogram.observe(seconds)

    def count_beat(self, lateness_s: float) -> None:
        self.heartbeats_sent += 1
        self.heartbeat_lateness.observe(max(0.0, lateness_s))

    def ended(self, outcome: str) -> int:
        return sum(n for (kind, _), n in self.examples_ended.items() if kind == outcome)

    @property
    def examples_completed(self) -> int:
        return self.ended("completed")

    @property
    def examples_failed(self) -> int:
        return self.ended("failed")

    @property
    def examples_cancelled(self) -> int:
        return self.ended("cancelled")

    @property
    def examples_running(self) -> int:
        return self.examples_started - sum(self.examples_ended.values())
