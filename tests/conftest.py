from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.processes import kill_all
from tests.recorded import TOKEN_VARIABLE, Hosts

SLOW_IMPORT_GATE = threading.Event()


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
