"""Crash and restore across processes: host A exports a parked episode and is killed; host B
restores it; its re-dispatch as attempt + 1 finishes it with exactly an uninterrupted run's
reward and side effects; a second re-dispatch is refused."""

from __future__ import annotations

import signal
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.helpers import wire
from tests.processes import LogReader, serve_process
from trio_gym.protocol.export import read_export
from trio_gym.runners import ExampleContext, ExampleRunner
from trio_gym.trainer import RolloutClient, RolloutError
from trio_gym.trainer.control import HostControl

TOKEN = "crash-test-token"
HANG_GUARD_S = 60


def host_process() -> AbstractAsyncContextManager[tuple[trio.Process, LogReader, int]]:
    return serve_process("--heartbeat-interval", "0.2", env={"NMP_CONTROL_TOKEN": TOKEN})


async def test_an_episode_exported_by_a_killed_host_finishes_once_on_another(
    tmp_path: Path,
) -> None:
    example: dict[str, Any] = {"seed": 11, "meetings": 5, "think_s": 0.3, "_ng_rollout_id": "cal"}
    expected = await ExampleRunner().run_example({**example, "think_s": 0}, ExampleContext("x", 0))
    export = tmp_path / "export"
    seen: list[Any] = []

    async with host_process() as (host_a, _, port_a), trio.open_nursery() as nursery:
        url_a = f"http://127.0.0.1:{port_a}"

        async def run_on_a() -> None:
            try:
                async for row in RolloutClient(url_a).stream([example]):
                    seen.append(row)
            except RolloutError as exc:
                seen.append(exc)

        nursery.start_soon(run_on_a)
        await trio.sleep(0.75)  # in its third step
        control_a = HostControl(url_a, TOKEN)
        with trio.fail_after(HANG_GUARD_S):
            prepared = wire(await control_a.prepare("c1", timeout_s=10))
            assert prepared["phase"] == "prepared"
            committed = wire(await control_a.commit("c1", str(export), timeout_s=10))
        host_a.send_signal(signal.SIGKILL)  # the crash: no resume, no goodbye
        await host_a.wait()
    assert committed["capture_keys"] == ["cal"]
    parked = read_export(export).records[("host", "episodes")][0]
    events = read_export(export).records[("calendar", "side_effect_store")][0]["events"]
    assert parked["step"] >= 1  # parked right after a step's booking
    assert len(events) == len(
        [e for e in expected["booked"] if e["request"] < parked["step"]]
    )  # the side effects so far travelled with it
    assert not any(isinstance(row, dict) for row in seen)  # A never delivered a result

    async with host_process() as (host_b, _, port_b):
        url_b = f"http://127.0.0.1:{port_b}"
        control_b = HostControl(url_b, TOKEN)
        client_b = RolloutClient(url_b)
        with trio.fail_after(HANG_GUARD_S):
            restored = wire(await control_b.restore("r1", str(export), timeout_s=10))
            results = await client_b.run([{**example, "_ng_attempt_index": 1}])
            with pytest.raises(RolloutError) as twice:
                await client_b.run([{**example, "_ng_attempt_index": 1}])
            await control_b.resume("r1", timeout_s=10)
            host_b.send_signal(signal.SIGTERM)
            assert await host_b.wait() == 0
    assert restored["restored"][0]["capture_key"] == "cal-a1"
    (result,) = results
    assert result["reward"] == expected["reward"]
    assert result["booked"] == expected["booked"]  # every side effect exactly once
    assert result["_ng_attempt_index"] == 1
    assert twice.value.code == "stale_attempt"
