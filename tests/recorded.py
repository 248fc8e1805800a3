"""Hosts launched as real processes whose runner records every example it starts (the hosts'
own side effects, read back to count runs), for the pool and reattach suites."""

from __future__ import annotations

import collections
import json
import uuid
from pathlib import Path
from typing import Any

import trio

from tests.processes import processes_with
from trio_gym.fleet import HostSpec

TOKEN_VARIABLE = "TRIO_GYM_POOL_TEST"


class Hosts:
    """One test's hosts: their spec, their record file, and the processes they leave."""

    def __init__(self, tmp_path: Path) -> None:
        self.token = uuid.uuid4().hex
        self.record = tmp_path / "record.jsonl"
        self.record.touch()

    def spec(
        self,
        runner: str = "tests.user_runner:recording",
        serve_args: tuple[str, ...] = (),
        **fields: Any,
    ) -> HostSpec:
        environment = {
            "NMP_RUNNER": runner,
            "TRIO_GYM_TEST_RECORD": str(self.record),
            TOKEN_VARIABLE: self.token,
        }
        fields = {"ready_timeout_s": 30.0, "stop_grace_s": 2.0, **fields}
        return HostSpec(environment, ("--heartbeat-interval", "0.2", *serve_args), **fields)

    def runs(self) -> list[dict[str, Any]]:
        """Every example start the hosts recorded (not their cancellations)."""
        lines = [json.loads(line) for line in self.record.read_text().splitlines()]
        return [line for line in lines if not line.get("cancelled")]

    def left_behind(self) -> list[int]:
        return processes_with(TOKEN_VARIABLE, self.token)

    async def first_host_to_run(self) -> int:
        """The pid of the host that started an example first (once one has)."""
        while not (runs := self.runs()):  # noqa: ASYNC110 (another process writes the file)
            await trio.sleep(0.01)
        pid: int = runs[0]["pid"]
        return pid


def examples(count: int, sleep_s: float) -> list[dict[str, Any]]:
    return [{"id": index, "sleep_s": sleep_s} for index in range(count)]


def assert_each_ran_once(hosts: Hosts, count: int) -> None:
    started = collections.Counter(run["id"] for run in hosts.runs())
    assert started == dict.fromkeys(range(count), 1)
