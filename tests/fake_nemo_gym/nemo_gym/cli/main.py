"""``gym env start +config_paths=[FILE]``, faked: what the host's ``gym`` runner launches.

It writes what it was started with (argv, working directory, environment, the config file) to
``fake-gym-start.json`` in its working directory, then behaves as the config's ``fake_gym``
block says (or, with no such block, the JSON in ``FAKE_GYM``, for a host given no global config):

- ``exit_at_s`` / ``exit_code``: exit by itself that long after starting;
- ``ready_at_s``: the head server's ``/health`` is 503 until then (``never`` for always);
- ``children``: start that many helper processes, half of them in process groups of their own
  (as Ray's workers are) and one that ignores SIGTERM, so stopping the tree is really tested;
- ``slow_after_reads``: reads of the head server's config beyond this many stall.

Its head server (on the config's ``head_server`` port) lists one agent, ``fake_agent``, served
by a fake agent server in this process (``tests/fake_gym.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import trio
import yaml

from tests.fake_gym import FakeAgentServer, FakeHeadServer, agent_instance

HELPER = """
import os, signal, sys, time
if sys.argv[1] == "own-group":
    os.setpgid(0, 0)
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(3600)
"""


def _config_file(argv: list[str]) -> Path:
    assert argv[1:3] == ["env", "start"], argv
    (override,) = argv[3:]
    prefix = "+config_paths=['"
    assert override.startswith(prefix) and override.endswith("']"), override
    return Path(override[len(prefix) : -2].replace("\\'", "'").replace("\\\\", "\\"))


def _start_children(count: int) -> list[subprocess.Popen[bytes]]:
    kinds = ["own-group", "plain", "stubborn"]
    return [
        subprocess.Popen([sys.executable, "-c", HELPER, kinds[index % len(kinds)]])
        for index in range(count)
    ]


async def _become_ready(head: FakeHeadServer, at_s: float) -> None:
    await trio.sleep(at_s)
    head.ready = True
    print("fake gym: ready", flush=True)


async def _serve(config: dict[str, Any], fake: dict[str, Any]) -> int:
    agent = FakeAgentServer("fake_agent")
    ready_at = fake.get("ready_at_s", 0)
    async with trio.open_nursery() as nursery:
        agent_port = await nursery.start(agent.serve)
        head = FakeHeadServer(
            {"fake_agent": agent_instance(agent_port)},
            ready=False,
            slow_after_reads=fake.get("slow_after_reads"),
        )
        await nursery.start(partial(head.serve, port=config["head_server"]["port"]))
        print(f"fake gym: head server on {config['head_server']['port']}", flush=True)
        if ready_at != "never":
            nursery.start_soon(_become_ready, head, ready_at)
        if "exit_at_s" not in fake:
            await trio.sleep_forever()
        await trio.sleep(fake["exit_at_s"])
        print(f"fake gym: exiting with {fake.get('exit_code', 3)}", flush=True)
        nursery.cancel_scope.cancel()
    return int(fake.get("exit_code", 3))


def main() -> None:
    argv = list(sys.argv)
    config_file = _config_file(argv)
    config = yaml.safe_load(config_file.read_text())
    record = {
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "config": config,
        "pid": os.getpid(),
    }
    Path("fake-gym-start.json").write_text(json.dumps(record))
    fake = config.get("fake_gym") or json.loads(os.environ.get("FAKE_GYM", "{}"))
    children = _start_children(fake.get("children", 0))
    print(f"fake gym: started {len(children)} helper(s)", flush=True)
    sys.exit(trio.run(_serve, config, fake))
