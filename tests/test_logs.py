"""Log lines: the same JSON whether written directly or through logging's records."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from trio_gym import logs


@pytest.fixture
def logger_restored() -> Iterator[None]:
    """The logger as it was, after a test that configures it."""
    saved = (list(logs.LOGGER.handlers), logs.LOGGER.level, logs.LOGGER.propagate, logs._lines)
    try:
        yield
    finally:
        handlers, level, propagate, lines = saved
        logs.LOGGER.handlers[:] = handlers
        logs.LOGGER.setLevel(level)
        logs.LOGGER.propagate = propagate
        logs._lines = lines


@pytest.mark.usefixtures("logger_restored")
def test_a_line_written_directly_reads_as_one_written_through_a_record() -> None:
    configured = io.StringIO()
    # Here, not in a fixture: pytest gives the logger capture handlers of its own for each
    # phase of a test, and lines are written directly only where ours is the only one.
    logs.configure(configured)
    logs.log_event("direct", batch="b1", examples=2, when=object)
    also_elsewhere = logging.NullHandler()  # an embedder's handler: records are made again
    logs.LOGGER.addHandler(also_elsewhere)
    logs.log_event("through_a_record", batch="b1", examples=2, when=object)
    logs.LOGGER.removeHandler(also_elsewhere)
    logs.log_event("below_the_level", level=logging.DEBUG)
    direct, recorded = (json.loads(line) for line in configured.getvalue().splitlines())
    assert direct.pop("event") == "direct" and recorded.pop("event") == "through_a_record"
    assert abs(direct.pop("ts") - recorded.pop("ts")) < 60
    assert (
        direct
        == recorded
        == {
            "level": "info",
            "batch": "b1",
            "examples": 2,
            "when": str(object),
        }
    )
