"""A user runner module whose import blocks until the test opens the gate (a slow import)."""

from tests.conftest import SLOW_IMPORT_GATE
from trio_gym.runners import ExampleRunner


def factory() -> ExampleRunner:
    return ExampleRunner()


SLOW_IMPORT_GATE.wait(timeout=60)
