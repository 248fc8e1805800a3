"""What a host counts."""

from __future__ import annotations

import attrs


@attrs.define
class HostStats:
    """Counters a test, a log line or an operator can read. Every example the host starts ends
    in exactly one of completed, failed or cancelled."""

    connections_open: int = 0
    batches_running: int = 0
    examples_started: int = 0
    examples_completed: int = 0
    examples_failed: int = 0
    examples_cancelled: int = 0

    def count_end(self, outcome: str) -> None:
        """Count an example's end: ``completed``, ``failed`` or ``cancelled``."""
        if outcome == "completed":
            self.examples_completed += 1
        elif outcome == "failed":
            self.examples_failed += 1
        else:
            self.examples_cancelled += 1

    @property
    def examples_running(self) -> int:
        ended = self.examples_completed + self.examples_failed + self.examples_cancelled
        return self.examples_started - ended
