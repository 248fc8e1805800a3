from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from tests.processes import kill_all
from tests.real_gym import REPO, RealGym, Stub, gym_site, real_gym_python
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


@pytest.fixture(scope="module")
def real_gym(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealGym]:
    """Real NeMo Gym's interpreter and the stub model its deployments call (one per module);
    the test is skipped, saying why, where Gym is not built."""
    python = real_gym_python()
    if python is None:
        pytest.skip(
            "real NeMo Gym is not built here: run scripts/gym_env.sh (it needs a Python 3.13; "
            ".ci/run does it)"
        )
    port_file = tmp_path_factory.mktemp("stub") / "port"
    stub = subprocess.Popen([sys.executable, "-m", "tests.stub_model", str(port_file)], cwd=REPO)
    try:
        deadline = time.monotonic() + 30  # clock-ok: a test fixture waiting for a subprocess
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and stub.poll() is None, (
                "the stub did not start"
            )  # clock-ok
            time.sleep(0.05)  # clock-ok
        yield RealGym(python, gym_site(python), Stub(stub, int(port_file.read_text())))
    finally:
        stub.kill()
        stub.wait()
