from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio.testing

from tests.processes import kill_all
from tests.recorded import TOKEN_VARIABLE, Hosts

SLOW_IMPORT_GATE = threading.Event()
# Longer than this machine's fsync of an export file (~0.5 ms, 0.8 ms worst of 300): while a
# worker thread writes, every task is blocked, and a clock that jumped at once would fire the
# deadlines the write is meant to meet (trio's MockClock docs: the smallest threshold that
# avoids false alarms while I/O is in flight).
DISK_SETTLE_S = 0.05


@pytest.fixture
def disk_clock() -> trio.testing.MockClock:
    """The autojump clock for tests whose code under test writes files from worker threads."""
    return trio.testing.MockClock(autojump_threshold=DISK_SETTLE_S)


@pytest.fixture
def slow_runner_module() -> Iterator[SimpleNamespace]:
    """``tests.slow_runner`` imports afresh and blocks until ``release()``."""
    sys.modules.pop("tests.slow_runner", None)
    SLOW_IMPORT_GATE.clear()
    yield SimpleNamespace(release=SLOW_IMPORT_GATE.set)
    SLOW_IMPORT_GATE.set()
    sys.modules.pop("tests.slow_runner", None)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    """Recording hosts' spec and record; their leftover processes killed after the test."""
    made = Hosts(tmp_path)
    yield made
    kill_all(TOKEN_VARIABLE, made.token)  # a failed test's leftovers; a passing one has none
