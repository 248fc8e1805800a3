"""Structured logs: one JSON object per line on stderr, one event per line.

Library code calls :func:`log_event`; only the command line installs the JSON-lines handler
(:func:`configure`), so an embedding program keeps control of its own logging.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

LOGGER = logging.getLogger("trio_gym")
_FIELDS = "trio_gym_fields"


def log_event(
    event: str, *, level: int = logging.INFO, exc_info: bool = False, **fields: Any
) -> None:
    """Log ``event`` with its fields (batch id, example index, ...)."""
    LOGGER.log(level, event, exc_info=exc_info, extra={_FIELDS: fields})


class JsonLinesFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "event": ..., <fields>}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        line.update(getattr(record, _FIELDS, {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(stream: TextIO = sys.stderr, level: int = logging.INFO) -> None:
    """Send trio_gym's events to ``stream`` as JSON lines (idempotent)."""
    for handler in list(LOGGER.handlers):
        LOGGER.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLinesFormatter())
    LOGGER.addHandler(handler)
    LOGGER.setLevel(level)
    LOGGER.propagate = False
