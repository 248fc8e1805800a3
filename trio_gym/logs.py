"""Structured logs: one JSON object per line on stderr, one event per line.

Library code calls :func:`log_event`; only the command line installs the JSON-lines handler
(:func:`configure`), so an embedding program keeps control of its own logging.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Final, TextIO

LOGGER = logging.getLogger("trio_gym")
_FIELDS = "trio_gym_fields"
_LEVEL_NAMES: Final = {
    level: logging.getLevelName(level).lower()
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
}
_ENCODER: Final = json.JSONEncoder(default=str)


def log_event(
    event: str, *, level: int = logging.INFO, exc_info: bool = False, **fields: Any
) -> None:
    """Log ``event`` with its fields (batch id, example index, ...)."""
    if _lines is not None and not exc_info and _lines.takes(level):
        _lines.write(level, event, fields)
        return
    LOGGER.log(level, event, exc_info=exc_info, extra={_FIELDS: fields})


def _line(created: float, level: str, event: str, fields: dict[str, Any]) -> str:
    return _ENCODER.encode({"ts": round(created, 3), "level": level, "event": event, **fields})


class JsonLinesFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "event": ..., <fields>}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, _FIELDS, {}))
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return _line(record.created, record.levelname.lower(), record.getMessage(), fields)


class _DirectLines:
    """The installed handler's lines, written without a ``LogRecord``.

    A record costs more than the line it becomes (about a tenth of a short batch's CPU went to
    two records); the line is the same either way. Only while the handler :func:`configure`
    installed is the logger's only one — an embedder's own handler gets records as usual.
    """

    def __init__(self, handler: logging.StreamHandler[TextIO]) -> None:
        self.handler = handler

    def takes(self, level: int) -> bool:
        handlers = LOGGER.handlers
        return (
            len(handlers) == 1
            and handlers[0] is self.handler
            and level >= LOGGER.level
            and not LOGGER.disabled
        )

    def write(self, level: int, event: str, fields: dict[str, Any]) -> None:
        name = _LEVEL_NAMES.get(level) or logging.getLevelName(level).lower()
        # A log line's timestamp is wall time by design (as a record's `created` is).
        text = _line(time.time(), name, event, fields) + "\n"  # clock-ok
        self.handler.acquire()  # the handler's own lock: records and lines never interleave
        try:
            self.handler.stream.write(text)
            self.handler.stream.flush()
        finally:
            self.handler.release()


_lines: _DirectLines | None = None


def configure(stream: TextIO = sys.stderr, level: int = logging.INFO) -> None:
    """Send trio_gym's events to ``stream`` as JSON lines (idempotent)."""
    global _lines
    for handler in list(LOGGER.handlers):
        LOGGER.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLinesFormatter())
    LOGGER.addHandler(handler)
    LOGGER.setLevel(level)
    LOGGER.propagate = False
    _lines = _DirectLines(handler)
