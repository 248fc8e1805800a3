from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

SLOW_IMPORT_GATE = threading.Event()


@pytest.fixture
def slow_runner_module() -> Iterator[SimpleNamespace]:
    """``tests.slow_runner`` imports afresh and blocks until ``release()``."""
    sys.modules.pop("tests.slow_runner", None)
    SLOW_IMPORT_GATE.clear()
    yield SimpleNamespace(release=SLOW_IMPORT_GATE.set)
    SLOW_IMPORT_GATE.set()
    sys.modules.pop("tests.slow_runner", None)
