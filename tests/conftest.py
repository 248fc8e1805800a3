from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from tests.processes import kill_all
from tests.recorded import TOKEN_VARIABLE, Hosts

SLOW_IMPORT_GATE = threading.Event()


class _HoldWhileThreadsRun(trio.abc.Instrument):
    """Keeps an autojump clock still while a worker thread runs.

    A task waiting for ``trio.to_thread.run_sync`` is blocked, so a plain autojump clock jumps
    to the next deadline while the thread works: a commit's deadline fired while its files were
    fsynced. With this, the clock jumps only when no thread of trio's default limiter is out
    (checked after every task step: where a thread starts, and where its result comes back).
    """

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self.clock = clock

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        busy = trio.to_thread.current_default_thread_limiter().borrowed_tokens > 0
        self.clock.autojump_threshold = math.inf if busy else 0


@pytest.fixture
def disk_clock() -> trio.testing.MockClock:
    """The autojump clock for tests whose code under test writes files from worker threads;
    such a test takes :func:`threads_hold_the_clock` beside it."""
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def threads_hold_the_clock(disk_clock: trio.testing.MockClock) -> trio.abc.Instrument:
    """:class:`_HoldWhileThreadsRun` on ``disk_clock`` (pytest-trio runs a test with the
    instruments among its arguments)."""
    return _HoldWhileThreadsRun(disk_clock)


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
