"""The drain: after a commit, wait for the replies already on the wire — and only for those.

The episodes a checkpoint must see settle are the few that were dispatched but not exported
(their host finished them before parking, so their replies are in flight). The drain looks each
of them up in the ledger and, while any is unsettled, sleeps until the ledger's next mutation:
each wake costs O(pending), never O(every rollout in the ledger). (Rebuilding the whole inventory
every 50 ms took 0.2 s a pass at 200,000 rollouts and blocked the very replies it waited for.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import trio

from .ledger import Ledger

SAMPLE: Final = 8


class DrainTimeout(Exception):
    """Replies that did not arrive in time: how many, and a short sample of their keys."""

    def __init__(self, count: int, sample: list[str], timeout_s: float) -> None:
        super().__init__(count, sample, timeout_s)
        self.count, self.sample, self.timeout_s = count, sample, timeout_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.count, self.sample, self.timeout_s))

    def __str__(self) -> str:
        more = (
            f" (and {self.count - len(self.sample)} more)" if self.count > len(self.sample) else ""
        )
        return (
            f"{self.count} episode(s) in flight did not settle within {self.timeout_s:g} s: "
            f"{', '.join(self.sample)}{more}"
        )


async def drain(ledger: Ledger, keys: Iterable[str], timeout_s: float) -> None:
    """Return once no attempt in ``keys`` is in flight (sealed, given up, refused at admission
    back to RESERVED, or superseded); raise
    :class:`DrainTimeout` if some are not within ``timeout_s``."""
    pending = set(keys)
    with trio.move_on_after(timeout_s):
        while True:
            cursor = ledger.mutations  # read before looking: a change after it wakes us at once
            pending = {key for key in pending if ledger.in_flight(key)}
            if not pending:
                return
            await ledger.wait_for_mutation(cursor)
    left = sorted(pending)
    raise DrainTimeout(len(left), left[:SAMPLE], timeout_s)
