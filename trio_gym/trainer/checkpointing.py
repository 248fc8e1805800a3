"""What taking a checkpoint (``coordinator.py``) and restoring one (``restore.py``) share: their
errors, their settings, and control calls made to every host at once."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import attrs
import trio

from trio_gym.logs import log_event
from trio_gym.protocol.control import Reply
from trio_gym.trainer.control import (
    REPLY_GRACE_S,
    ControlError,
    ControlTimeout,
    HostControl,
    ReplyMismatch,
)
from trio_gym.trainer.dispatch import Dispatcher

T = TypeVar("T")
R = TypeVar("R", bound=Reply)


class _PicklableError(Exception):
    """An error whose every argument is a string: it pickles as itself (trainers run workers)."""

    def __init__(self, message: str, checkpoint_id: str = "") -> None:
        super().__init__(message, checkpoint_id)
        self.message, self.checkpoint_id = message, checkpoint_id

    def __str__(self) -> str:
        return self.message


class CheckpointUnavailable(_PicklableError):
    """This checkpoint could not be taken now (a host could not park, did not answer, died, or
    its control plane failed); every host was resumed. Try again at the next opportunity."""


class CheckpointAborted(_PicklableError):
    """A mismatch that retrying would hide (ownership, topology, a reply that does not fit the
    ledger or the contract), or too many unavailable checkpoints in a row. Nothing was written."""


class RestoreRefused(_PicklableError):
    """The checkpoint does not fit the live hosts or its files; nothing was changed."""


class RestoreFailed(_PicklableError):
    """A host failed to restore; every host retired the restored attempts and resumed."""


@attrs.frozen
class CheckpointSettings:
    control_timeout_s: float = 30.0
    """Each control call's own deadline (it is also bounded by the reply grace)."""
    prepare_timeout_s: float = 120.0
    """How long hosts may take to park every episode at a step boundary."""
    lease_s: float = 60.0
    drain_timeout_s: float = 120.0
    gate_timeout_s: float = 120.0
    """How long closing the gate may wait for submissions under way (their heads)."""
    max_consecutive_failures: int = 3

    def __attrs_post_init__(self) -> None:
        if self.max_consecutive_failures < 1:
            raise ValueError("max_consecutive_failures must be at least 1")


async def fitting(call: Awaitable[R], checkpoint_id: str) -> R:
    """A control call's reply, where a reply that does not fit aborts the checkpoint: the
    host would answer the same way again, so retrying would only hide it."""
    try:
        return await call
    except ReplyMismatch as exc:
        raise CheckpointAborted(exc.message, checkpoint_id) from exc


def absolute(directory: Path) -> Path:
    """``directory`` made absolute: hosts read and write their exports under it."""
    return Path(os.path.abspath(directory))


@attrs.frozen
class EveryHost:
    """The control planes of a dispatcher's hosts, called all at once."""

    dispatcher: Dispatcher
    settings: CheckpointSettings

    def control(self, host: str) -> HostControl:
        return self.dispatcher.hosts[host].control

    async def call(self, call: Callable[[str], Awaitable[T]]) -> dict[str, T]:
        """``call`` on every host concurrently; its replies by host, or one error naming each
        host that failed (an abort wins over unavailability; bugs propagate as themselves)."""
        replies: dict[str, T] = {}
        failures: dict[str, Exception] = {}

        async def one(host: str) -> None:
            try:
                replies[host] = await call(host)
            except (ControlError, CheckpointUnavailable, CheckpointAborted) as error:
                failures[host] = error
                if isinstance(error, ControlTimeout):  # no answer: the scheduler probes it
                    self.dispatcher.scheduler.suspect(host, f"a control call failed: {error}")

        async with trio.open_nursery() as nursery:
            for host in self.dispatcher.hosts:
                nursery.start_soon(one, host)
        if failures:
            summary = "; ".join(f"{host}: {error}" for host, error in sorted(failures.items()))
            aborts = [e for e in failures.values() if isinstance(e, CheckpointAborted)]
            if aborts:
                raise CheckpointAborted(summary, aborts[0].checkpoint_id)
            raise CheckpointUnavailable(summary)
        return replies

    async def call_regardless(
        self, call: Callable[[str], Awaitable[object]], *, calls: int, event: str
    ) -> None:
        """:meth:`call`, on every path: under a shield bounded by ``calls`` control calls (each
        its deadline plus the reply grace), and a failure is logged, never raised — it must not
        replace the error that brought us here."""
        timeout = self.settings.control_timeout_s
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + calls * (timeout + REPLY_GRACE_S) + 1
            try:
                await self.call(call)
            except (CheckpointUnavailable, CheckpointAborted) as failure:
                log_event(event, error=str(failure))

    async def resume(self, checkpoint_id: str) -> None:
        """Resume every host; one that does not answer is logged (its lease resumes it)."""
        timeout = self.settings.control_timeout_s
        await self.call_regardless(
            lambda host: self.control(host).resume(checkpoint_id, timeout_s=timeout),
            calls=1,
            event="resume_failed",
        )
