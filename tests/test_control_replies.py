"""The trainer reads every control reply it acts on through the protocol's reply models: a reply
that does not fit is refused naming the host, the operation and the field, never read with a
default."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.fleet import Fleet, calendar, fleet
from trio_gym.protocol.control import CheckpointPhase
from trio_gym.trainer.control import HostControl, ReplyMismatch
from trio_gym.trainer.coordinator import CheckpointAborted, RestoreFailed
from trio_gym.trainer.manifest import MANIFEST_NAME

Change = Callable[[dict[str, Any]], None]


class Tampered(HostControl):
    """A host whose replies to ``operation`` are changed by ``change`` before the trainer
    reads them (once :func:`tamper` says so)."""

    operation = ""
    change: Change = staticmethod(lambda reply: None)

    async def _exchange(self, operation: Any, request: Any, timeout_s: float) -> Any:
        reply = await super()._exchange(operation, request, timeout_s)
        if operation.name == self.operation:
            self.change(reply)
        return reply


TAMPERABLE = {"a": Tampered, "b": Tampered}


def tamper(f: Fleet, host: str, operation: str, change: Change) -> None:
    control = f.dispatcher.hosts[host].control
    assert isinstance(control, Tampered)
    control.operation, control.change = operation, change


def idle(f: Fleet) -> bool:
    return all(
        h.services.checkpoints.status().phase == CheckpointPhase.IDLE for h in f.hosts.values()
    )


async def test_a_prepare_reply_that_does_not_fit_aborts_the_checkpoint(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with fleet(controls=TAMPERABLE) as f:
        tamper(f, "b", "prepare", lambda reply: reply.pop("blockers"))
        with pytest.raises(
            CheckpointAborted,
            match="b's prepare reply does not fit the contract: blockers: Field required",
        ):
            await f.coordinator.checkpoint(tmp_path / "c1")
        assert idle(f) and f.dispatcher.gate.is_open
    assert not (tmp_path / "c1" / MANIFEST_NAME).exists()


def in_a_checkpoint_naming_none(reply: dict[str, Any]) -> None:
    reply.update(phase="prepared", checkpoint_id=None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda reply: reply.pop("participants"),
            "a's status reply does not fit the contract: participants: Field",
        ),
        (in_a_checkpoint_naming_none, "phase prepared names no checkpoint_id"),
    ],
)
async def test_a_status_reply_that_does_not_fit_aborts_a_take_over(
    autojump_clock: trio.abc.Clock, change: Change, message: str
) -> None:
    async with fleet(controls=TAMPERABLE) as f:
        tamper(f, "a", "status", change)
        with pytest.raises(CheckpointAborted, match=message):
            await f.coordinator.take_over()


async def test_a_restore_reply_that_does_not_fit_is_undone_on_every_host(
    disk_clock: trio.abc.Clock, threads_hold_the_clock: trio.abc.Instrument, tmp_path: Path
) -> None:
    async with fleet(controls=TAMPERABLE) as f, trio.open_nursery() as nursery:
        nursery.start_soon(f.dispatcher.run_group, "g", [calendar(1), calendar(2)])  # a, b
        await trio.sleep(3)
        manifest = await f.coordinator.checkpoint(tmp_path / "c1")
        nursery.cancel_scope.cancel()
    assert all(host.episodes for host in manifest.hosts)

    def unnamed(reply: dict[str, Any]) -> None:
        for entry in reply["restored"]:
            del entry["capture_key"]

    async with fleet(controls=TAMPERABLE) as f:
        tamper(f, "b", "restore", unnamed)
        with pytest.raises(
            RestoreFailed,
            match=r"b's restore reply does not fit the contract: restored\.0\.capture_key",
        ):
            await f.coordinator.restore(tmp_path / "c1")
        assert idle(f) and not f.dispatcher.ledger.groups
        assert all(h.services.checkpoints.status().counts.restored == 0 for h in f.hosts.values())


async def test_a_retire_reply_that_does_not_fit_keeps_the_attempts_queued(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with fleet(("a",), controls=TAMPERABLE) as f:
        tamper(f, "a", "retire", lambda reply: reply.pop("still_stopping"))
        f.dispatcher.to_retire["a"].add(("g.0@lost", 0))
        with pytest.raises(
            ReplyMismatch, match="a's retire reply does not fit the contract: still_stopping"
        ) as refused:
            await f.dispatcher.retire_queued("a")
        assert f.dispatcher.to_retire["a"] == {("g.0@lost", 0)}
    again = pickle.loads(pickle.dumps(refused.value))
    assert type(again) is ReplyMismatch and str(again) == str(refused.value)
