"""Which connections a host serves in full, which it only refuses, and which it drops."""

from __future__ import annotations

from typing import Final

import attrs
import trio

from trio_gym.config import ServeConfig
from trio_gym.errors import ErrorCode, WireError
from trio_gym.http import HttpLimits

from .stats import HostStats

# How long an over-cap connection may take to send its head, and how long its close drains.
REFUSAL_TIMEOUT_S: Final = 2.0


def host_busy(serving: str, setting: str, variable: str) -> WireError:
    """``503 host_busy``, the answer at any of the host's limits: ``serving`` says which one,
    ``setting`` and ``variable`` what raises it."""
    return WireError(
        ErrorCode.HOST_BUSY,
        f"the host is {serving}; retry shortly, or raise {setting} ({variable})",
        headers=[("retry-after", "1")],
    )


@attrs.frozen(eq=False)
class Admitted:
    """A connection let in: served in full, or (``busy``) only told that the host is full, on
    the short timeouts of ``limits``."""

    busy: bool
    limits: HttpLimits
    slots: trio.CapacityLimiter


@attrs.frozen(eq=False)
class Ticket:
    """One connection's place, until its socket closes (the connection's ``on_close``, once):
    a handler may hold a keyed batch on after that."""

    admitted: Admitted
    _admission: Admission

    def release(self) -> None:
        """Give the place back; synchronous, so cancellation cannot lose it."""
        self._admission.release(self)


class Admission:
    """Up to ``max_connections`` connections are served in full; beyond that, a bounded
    overflow (a quarter of the cap, at least 8) hears a clear 503 on short timeouts; beyond
    the overflow too, a connection is dropped at once, so a flood costs neither memory nor
    time."""

    def __init__(self, config: ServeConfig, limits: HttpLimits, stats: HostStats) -> None:
        self._stats = stats
        self.served = Admitted(False, limits, trio.CapacityLimiter(config.max_connections))
        refusal_limits = attrs.evolve(
            limits,
            read_timeout_s=min(limits.read_timeout_s, REFUSAL_TIMEOUT_S),
            drain_timeout_s=REFUSAL_TIMEOUT_S,
        )
        overflow = trio.CapacityLimiter(max(8, config.max_connections // 4))
        self.refused = Admitted(True, refusal_limits, overflow)

    def admit(self) -> Ticket | None:
        """Take a slot for a new connection, served or refused; ``None``: drop it."""
        for admitted in (self.served, self.refused):
            ticket = Ticket(admitted, self)
            try:
                admitted.slots.acquire_on_behalf_of_nowait(ticket)
            except trio.WouldBlock:
                continue
            if not admitted.busy:
                self._stats.connections_open += 1
                self._stats.connections_accepted += 1
            return ticket
        self._stats.connections_refused["dropped"] += 1
        return None

    def release(self, ticket: Ticket) -> None:
        """Give back what :meth:`admit` took (through its :class:`Ticket`)."""
        if not ticket.admitted.busy:
            self._stats.connections_open -= 1
        ticket.admitted.slots.release_on_behalf_of(ticket)
