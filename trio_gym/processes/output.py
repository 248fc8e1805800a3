"""A child's output, logged line by line as it comes, with its last lines kept for an error."""

from __future__ import annotations

import re
from collections import deque
from typing import Final

import trio

from trio_gym.logs import log_event

# How much of a child's output a failure message quotes (all of it is in the log).
TAIL_LINES: Final = 15


class OutputTail:
    """Logs every line a child prints as a ``process_output`` event and keeps the last few,
    and the first line that matches ``remember``: a cause printed long before the end (uv's
    error, above a server's traceback and Gym's own) is what a failure must name first."""

    def __init__(
        self, process: str, lines: int = TAIL_LINES, *, remember: re.Pattern[str] | None = None
    ) -> None:
        self.process = process
        self.remember = remember
        self.remembered: re.Match[str] | None = None
        self._lines: deque[str] = deque(maxlen=lines)
        self._pending: dict[str, bytes] = {}

    async def pump(self, stream_name: str, stream: trio.abc.ReceiveStream) -> None:
        """Read ``stream`` to its end, a line at a time (a last line without a newline too).

        Cancelled, it loses nothing: a line begun is kept, and a later ``pump`` of the same
        stream name carries on from it."""
        while data := await stream.receive_some(65536):
            *lines, self._pending[stream_name] = (self._pending.get(stream_name, b"") + data).split(
                b"\n"
            )
            for line in lines:
                self._note(stream_name, line)
        if rest := self._pending.pop(stream_name, b""):
            self._note(stream_name, rest)

    def _note(self, stream_name: str, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip()
        if text:
            self._lines.append(text)
            if self.remembered is None and self.remember is not None:
                self.remembered = self.remember.search(text)
            log_event("process_output", process=self.process, stream=stream_name, line=text)

    def text(self) -> str:
        """The last lines, oldest first, one per line."""
        return "\n".join(self._lines)
