"""A user runner module whose examples, once cancelled, take a while to clean up (closing a
sandbox, say): a stopping host waits for them within its grace, and stays ``shutting_down``."""

from __future__ import annotations

from typing import Any

import attrs
import trio


@attrs.define
class SlowToStop:
    cleanup_s: float = 5.0

    def check_example(self, example: Any) -> None:
        pass

    async def run_example(self, example: Any, context: Any) -> Any:
        try:
            await trio.sleep(3600)
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(self.cleanup_s)


def factory() -> SlowToStop:
    return SlowToStop()
