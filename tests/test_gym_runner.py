"""The ``gym`` runner's side of the bargain, against a stand-in for Gym's launcher.

What the host starts Gym with (config, environment, working directory), readiness, a Gym that
exits or never comes up, and that nothing Gym started outlives the host — stopped, or killed.
The real nemo-gym is in ``tests/test_gym_real.py``.
"""

from __future__ import annotations

import json
import logging
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.fake_gym import FakeHeadServer, agent_instance
from tests.helpers import request_bytes, running_host, tcp_exchange
from tests.packages import native_package
from tests.processes import LogReader, kill_all, processes_with, serve_process
from trio_gym.config import ServeConfig, load_serve_config
from trio_gym.host import Host
from trio_gym.host.lifecycle import Failed
from trio_gym.http import Endpoint, HttpLimits
from trio_gym.install import load_package
from trio_gym.processes.output import OutputTail
from trio_gym.runners.deployment import START_POLL_S, wait_for_deployment
from trio_gym.runners.gym import (
    DEPLOYMENT_VARIABLE,
    INDEX_UNREACHABLE,
    GymStartFailed,
    check_ray_socket_paths,
    gym_environment,
    gym_global_config,
    gym_python,
    index_unreachable,
    launch_argv,
)

HANG_GUARD_S = 60
FAKE_GYM = Path(__file__).parent / "fake_nemo_gym"
REPO = Path(__file__).parent.parent
ROW = {"agent_ref": {"name": "fake_agent"}, "responses_create_params": {"input": "hi"}}


@pytest.fixture
def fake_gym_python(tmp_path: Path) -> Iterator[str]:
    """An interpreter whose ``nemo_gym`` is the stand-in. Whatever a failed test left of its
    stand-ins is killed after it — only its own: another test session may run some meanwhile."""
    token = secrets.token_hex(8)
    script = tmp_path / "gym-python"
    path = f'"{FAKE_GYM}:{REPO}${{PYTHONPATH:+:$PYTHONPATH}}"'
    script.write_text(
        f'#!/bin/sh\nTRIO_GYM_FAKE_GYM={token} PYTHONPATH={path} exec "{sys.executable}" "$@"\n'
    )
    script.chmod(0o755)
    yield str(script)
    kill_all("TRIO_GYM_FAKE_GYM", token)


def started_with(work: Path) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((work / "gym" / "fake-gym-start.json").read_text())
    return record


def gym_processes(tag: str) -> list[int]:
    """Every live process of the deployment tagged ``tag`` (the tag is inherited)."""
    return processes_with(DEPLOYMENT_VARIABLE, tag)


async def until_no_gym_process(tag: str) -> None:
    with trio.fail_after(HANG_GUARD_S):
        while gym_processes(tag):  # noqa: ASYNC110 - other processes' ends cannot be awaited
            await trio.sleep(0.05)


def gym_config(tmp_path: Path, gym_python: str, fake: dict[str, Any], **config: Any) -> ServeConfig:
    settings: dict[str, Any] = {
        "port": 0,
        "runner": "gym",
        "gym_python": gym_python,
        "gym_global_config": {"policy_model_name": "stub", "fake_gym": fake},
        "work_path": str(tmp_path / "work"),
        "gym_stop_grace_s": 1.0,
        "agent_retry_backoff_s": 0.05,
        **config,
    }
    return ServeConfig(**settings)


@asynccontextmanager
async def gym_host(config: ServeConfig) -> AsyncIterator[tuple[Host, int]]:
    async with running_host(config) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            await host.lifecycle.settled.wait()
        yield host, port


async def health(port: int) -> Any:
    return await tcp_exchange(port, request_bytes(method="GET", target="/health"))


# --- what Gym is started with ---------------------------------------------------------------


def test_the_global_config_puts_the_package_first_and_a_loopback_head_server(
    tmp_path: Path,
) -> None:
    package = load_package(native_package(tmp_path / "env"))
    given = {"policy_base_url": "http://model/v1", "config_paths": ["responses_api_models/m.yaml"]}
    config = gym_global_config(given, package, head_port=4321, environ={})
    assert config["config_paths"] == [
        str(package.root / "responses_api_agents/calendar/configs/agent.yaml"),
        str(package.root / "resources_servers/calendar/configs/tools.yaml"),
        "responses_api_models/m.yaml",
    ]
    assert config["head_server"] == {"host": "127.0.0.1", "port": 4321}
    assert config["policy_base_url"] == "http://model/v1"
    assert given == {
        "policy_base_url": "http://model/v1",
        "config_paths": ["responses_api_models/m.yaml"],
    }
    named = gym_global_config({"head_server": {"port": 11000}}, None, head_port=1, environ={})
    assert named["head_server"] == {"host": "127.0.0.1", "port": 11000}


def test_the_operators_uv_directories_reach_gyms_config_unless_it_names_its_own() -> None:
    environ = {"UV_CACHE_DIR": "/cache/uv", "NEMO_GYM_VENV_DIR": "/venvs"}
    config = gym_global_config({}, None, head_port=1, environ=environ)
    assert (config["uv_cache_dir"], config["uv_venv_dir"]) == ("/cache/uv", "/venvs")
    own = gym_global_config({"uv_cache_dir": "/mine"}, None, head_port=1, environ=environ)
    assert own["uv_cache_dir"] == "/mine"


MODEL = "responses_api_models/openai_model/configs/openai_model.yaml"
IMAGE_AGENT = "responses_api_agents/simple_agent/configs/simple_agent.yaml"
IMAGE_WEATHER = "resources_servers/weather/configs/weather.yaml"


def choice(agent: str, resources: str, *, agent_config: str | None = IMAGE_AGENT) -> Any:
    """What the upstream orchestrator sends: its component choice, and always its own
    config_paths (the model, the conventional resources-server path, the agent config)."""
    selection = {
        "agent_instance": agent,
        "resources_server_instance": resources,
        "resources_server_config": f"resources_servers/{resources}/configs/{resources}.yaml",
        "model_config": MODEL,
        **({} if agent_config is None else {"agent_config": agent_config}),
    }
    own = [MODEL, selection["resources_server_config"], *([agent_config] if agent_config else [])]
    return {"_nmp_environment_component_selection": selection, "config_paths": own}


@pytest.mark.parametrize(
    ("agent", "resources", "agent_config", "added"),
    [
        # The package's own agent and resources server: only the model is the operator's.
        ("calendar_agent", "calendar_tools", IMAGE_AGENT, [MODEL]),
        ("calendar_agent", "calendar_tools", None, [MODEL]),
        # The package's agent with the image's resources server, with and without a fallback
        # agent config: the agent config is never loaded, the resources server's always.
        (
            "calendar_agent",
            "weather",
            IMAGE_AGENT,
            [MODEL, "resources_servers/weather/configs/weather.yaml"],
        ),
        (
            "calendar_agent",
            "weather",
            None,
            [MODEL, "resources_servers/weather/configs/weather.yaml"],
        ),
        # An agent the package lacks: its config from the choice, before the model's.
        ("simple_agent", "calendar_tools", IMAGE_AGENT, [IMAGE_AGENT, MODEL]),
    ],
)
def test_a_component_choice_replaces_the_orchestrators_config_paths_by_the_upstream_rule(
    tmp_path: Path, agent: str, resources: str, agent_config: str | None, added: list[str]
) -> None:
    package = load_package(native_package(tmp_path / "env"))
    given = choice(agent, resources, agent_config=agent_config)
    config = gym_global_config(given, package, head_port=1, environ={})
    assert "_nmp_environment_component_selection" not in config
    assert config["config_paths"] == [
        str(package.root / "responses_api_agents/calendar/configs/agent.yaml"),
        str(package.root / "resources_servers/calendar/configs/tools.yaml"),
        *added,
    ]


def test_a_component_choice_needs_the_package_and_a_config_for_an_agent_it_lacks(
    tmp_path: Path,
) -> None:
    package = load_package(native_package(tmp_path / "env"))
    lacking = choice("simple_agent", "calendar_tools", agent_config=None)
    with pytest.raises(GymStartFailed, match="no agent 'simple_agent'"):
        gym_global_config(lacking, package, head_port=1, environ={})
    with pytest.raises(GymStartFailed, match="there is none; set NMP_ENVIRONMENT_PATH"):
        gym_global_config(choice("calendar_agent", "weather"), None, head_port=1, environ={})


def test_gym_gets_the_hosts_environment_but_never_its_control_token(tmp_path: Path) -> None:
    package = load_package(native_package(tmp_path / "env"))
    environ = {
        "NMP_CONTROL_TOKEN": "secret",
        "UV_OFFLINE": "1",
        "NEMO_GYM_EXTRA_ROOTS": "/other",
        "PATH": "/usr/bin:/opt/gym/bin",
    }
    config = ServeConfig(
        runner="gym", gym_global_config={}, broker_url="http://b", broker_token="t"
    )
    env = gym_environment(environ, config, package, python="/opt/gym/bin/python", tag="tag-1")
    assert "NMP_CONTROL_TOKEN" not in env and env["UV_OFFLINE"] == "1"
    assert env["NEMO_GYM_EXTRA_ROOTS"] == f"{package.root}:/other"
    assert (env["NMP_BROKER_URL"], env["NMP_BROKER_TOKEN"]) == ("http://b", "t")
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and env[DEPLOYMENT_VARIABLE] == "tag-1"
    assert env["PATH"].startswith("/opt/gym/bin:/usr/bin")  # Gym's environment, as if activated
    joining = ServeConfig(
        runner="gym", gym_global_config={"ray_head_node_address": "10.0.0.1:6379"}
    )
    alone = gym_environment({}, joining, None, python="/py", tag="t")
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in alone


def test_the_launcher_is_gyms_own_and_the_config_path_survives_hydra_quoting() -> None:
    argv = launch_argv("/py", Path("/work/it's here/config.yaml"))
    assert argv[:2] == ["/py", "-c"] and "from nemo_gym.cli.main import main" in argv[2]
    assert argv[3:] == ["env", "start", "+config_paths=['/work/it\\'s here/config.yaml']"]


def test_without_nemo_gym_here_the_gym_python_must_be_named() -> None:
    with pytest.raises(GymStartFailed, match="--gym-python") as refused:
        gym_python("")
    assert sys.executable in str(refused.value)
    assert gym_python("/opt/gym/bin/python") == "/opt/gym/bin/python"


def test_a_gym_config_without_a_runner_means_runner_gym() -> None:
    config = load_serve_config(environ={"NMP_GYM_GLOBAL_CONFIG": '{"policy_model_name": "m"}'})
    assert config.runner == "gym" and config.gym_global_config == {"policy_model_name": "m"}
    assert load_serve_config(environ={"NMP_GYM_GLOBAL_CONFIG": "{}"}).runner == "gym"


# --- the deployment's life -------------------------------------------------------------------


async def test_the_host_starts_gym_waits_for_it_and_runs_rows_through_it(
    tmp_path: Path, fake_gym_python: str
) -> None:
    package = native_package(tmp_path / "env")
    config = gym_config(
        tmp_path,
        fake_gym_python,
        {"ready_at_s": 1.0},
        environment_path=str(package),
        environment_offline=True,
        dataset_path="/data",
        control_token="host-secret",
    )
    async with running_host(config) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            await host.lifecycle.wait_for_phase(
                lambda phase: getattr(phase, "stage", "") == "starting_gym"
            )
        starting = await health(port)
        with trio.fail_after(HANG_GUARD_S):
            await host.lifecycle.settled.wait()
        ready = await health(port)
        reply = await tcp_exchange(port, request_bytes({"examples": [ROW]}))
    start = started_with(tmp_path / "work")
    assert starting.status == 503 and starting.json()["stage"] == "starting_gym"
    assert ready.status == 200, ready.json()
    assert reply.json()["results"][0]["agent"] == "fake_agent"
    assert start["cwd"] == str(tmp_path / "work" / "gym")
    assert start["config"]["config_paths"][0] == str(
        package / "responses_api_agents/calendar/configs/agent.yaml"
    )
    assert start["config"]["policy_model_name"] == "stub"
    env = start["env"]
    assert env["UV_OFFLINE"] == "1"  # the installer stage's choice reaches Gym's venv builds
    assert env["NEMO_GYM_EXTRA_ROOTS"].split(":")[0] == str(package)
    assert env["NMP_DATASET_PATH"] == "/data" and "NMP_CONTROL_TOKEN" not in env
    await until_no_gym_process(env[DEPLOYMENT_VARIABLE])


async def test_a_gym_that_exits_before_it_is_up_fails_the_start_with_its_last_words(
    tmp_path: Path, fake_gym_python: str
) -> None:
    config = gym_config(
        tmp_path, fake_gym_python, {"ready_at_s": "never", "exit_at_s": 0.5, "exit_code": 7}
    )
    async with gym_host(config) as (host, port):
        reply = await health(port)
    document = reply.json()
    assert reply.status == 503 and document["status"] == "failed"
    assert document["stage"] == "starting_gym" and document["error"]["code"] == "bootstrap_failed"
    assert "Gym exited with status 7 before it was up" in document["error"]["message"]
    assert "fake gym: exiting with 7" in document["error"]["message"]
    assert "no Gym global config" not in document["error"]["message"]


async def test_a_gym_started_without_a_global_config_that_fails_says_none_was_given(
    tmp_path: Path,
    fake_gym_python: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trio_gym")
    monkeypatch.setenv("FAKE_GYM", json.dumps({"ready_at_s": "never", "exit_at_s": 0.2}))
    config = gym_config(tmp_path, fake_gym_python, {}, gym_global_config=None)
    async with gym_host(config) as (host, port):
        reply = await health(port)
    message = reply.json()["error"]["message"]
    assert "Gym exited with status 3 before it was up" in message
    assert "no Gym global config was given" in message and "NMP_GYM_GLOBAL_CONFIG" in message
    (failed,) = [r for r in caplog.records if r.getMessage() == "stage_failed"]
    assert failed.levelno == logging.ERROR  # seen at the default level, not lost among Gym's lines


async def test_a_gym_that_is_never_up_fails_at_the_start_timeout_and_is_stopped(
    tmp_path: Path, fake_gym_python: str
) -> None:
    fake = {"ready_at_s": "never", "children": 3}
    config = gym_config(tmp_path, fake_gym_python, fake, gym_start_timeout_s=1.0)
    async with gym_host(config) as (host, port):
        reply = await health(port)
        tag = started_with(tmp_path / "work")["env"][DEPLOYMENT_VARIABLE]
        await until_no_gym_process(tag)  # stopped at the timeout, the host still up
        assert host.lifecycle.shutdown_requested.is_set() is False
    message = reply.json()["error"]["message"]
    assert "was not up within 1 s (gym_start_timeout_s)" in message
    assert "says the deployment is not ready (HTTP 503)" in message


async def test_a_gym_that_exits_after_it_is_up_turns_health_failed(
    tmp_path: Path, fake_gym_python: str
) -> None:
    config = gym_config(tmp_path, fake_gym_python, {"exit_at_s": 1.5, "exit_code": 9})
    async with gym_host(config) as (host, port):
        assert (await health(port)).status == 200
        with trio.fail_after(HANG_GUARD_S):
            await host.lifecycle.wait_for_phase(lambda phase: isinstance(phase, Failed))
        reply = await health(port)
        refused = await tcp_exchange(port, request_bytes({"examples": [ROW]}))
    document = reply.json()
    assert document["status"] == "failed" and document["stage"] == "gym"
    assert "the Gym deployment exited with status 9" in document["error"]["message"]
    assert refused.status == 503 and refused.json()["error"]["code"] == "bootstrap_failed"


async def test_a_gym_that_exits_while_the_runner_starts_leaves_the_host_failed(
    tmp_path: Path, fake_gym_python: str
) -> None:
    # Up at once; the runner's own read of the deployment then stalls, and Gym exits meanwhile.
    fake = {"slow_after_reads": 1, "exit_at_s": 1.5, "exit_code": 4}
    config = gym_config(tmp_path, fake_gym_python, fake)
    async with gym_host(config) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            await host.lifecycle.settled.wait()
        reply = await health(port)
    document = reply.json()
    assert document["status"] == "failed" and document["stage"] == "gym"
    assert "the Gym deployment exited with status 4" in document["error"]["message"]


async def test_stopping_the_host_stops_every_gym_process(
    tmp_path: Path, fake_gym_python: str
) -> None:
    config = gym_config(tmp_path, fake_gym_python, {"children": 3})
    async with gym_host(config) as (host, port):
        tag = started_with(tmp_path / "work")["env"][DEPLOYMENT_VARIABLE]
        assert len(gym_processes(tag)) >= 4  # the launcher and its helpers
    assert gym_processes(tag) == []  # the host's stop waited for every one to be gone


# --- a host launched as a sandbox process -----------------------------------------------------


@asynccontextmanager
async def serve_gym(
    tmp_path: Path, gym_python: str, fake: dict[str, Any]
) -> AsyncIterator[tuple[trio.Process, LogReader, str]]:
    """``trio-gym serve`` as the upstream orchestrator launches it: no runner named."""
    env = {
        "NMP_GYM_GLOBAL_CONFIG": json.dumps({"fake_gym": fake}),
        "NMP_GYM_PYTHON": gym_python,
        "NMP_WORK_PATH": str(tmp_path / "work"),
        "NMP_GYM_STOP_GRACE_S": "1",
    }
    async with serve_process(env=env) as (process, logs, port):
        starting = next(event for event in logs.events if event["event"] == "gym_starting")
        yield process, logs, starting["deployment"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
async def test_no_gym_process_outlives_a_host_stopped_or_killed(
    tmp_path: Path, fake_gym_python: str, signum: int
) -> None:
    async with serve_gym(tmp_path, fake_gym_python, {"children": 3}) as (process, logs, tag):
        assert len(gym_processes(tag)) >= 4
        process.send_signal(signum)
        with trio.fail_after(HANG_GUARD_S):
            await process.wait()
    if signum == signal.SIGTERM:
        assert gym_processes(tag) == []  # the host exits only once Gym is gone
    else:
        await until_no_gym_process(tag)  # the guard, told by the lifeline, does it alone


def test_a_ray_temp_directory_too_long_for_its_sockets_is_refused_naming_it() -> None:
    check_ray_socket_paths({})  # /tmp/ray/...: 76 bytes
    short = "/w/" + "x" * 30
    check_ray_socket_paths({"TMPDIR": short})
    long = "/sandbox/work/" + "deep/" * 6 + "tmp"
    with pytest.raises(GymStartFailed, match=r"up to 115 bytes .*over the 107 bytes") as refused:
        check_ray_socket_paths({"TMPDIR": long})
    assert f"({long}/ray/session_" in str(refused.value) and "RAY_TMPDIR" in str(refused.value)
    check_ray_socket_paths({"TMPDIR": long, "RAY_TMPDIR": short})  # Ray's own variable first


async def test_a_starting_deployment_is_seen_up_within_a_poll_and_its_wait_logged_once(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Found measuring where a Gym host's start goes (issue 37): a growing backoff noticed Gym
    up to 5 s after it said all its servers were ready. Virtual time, in-memory streams."""
    caplog.set_level(logging.INFO, logger="trio_gym")
    head = FakeHeadServer({"agent": agent_instance(9)}, ready=False)
    async with trio.open_nursery() as nursery:

        async def opener(endpoint: object) -> trio.abc.Stream:
            await trio.lowlevel.checkpoint()
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(head.handle, server)
            return client

        async def ready_at_last() -> None:
            await trio.sleep(300.1)  # between two looks, whichever cadence
            head.ready = True

        nursery.start_soon(ready_at_last)
        await wait_for_deployment(
            Endpoint.parse("http://head.invalid:1"),
            limits=HttpLimits(),
            opener=opener,
            timeout_s=600,
            probe_servers=False,
        )
        seen_after = trio.current_time() - 300.1
    waits = [record for record in caplog.records if record.getMessage() == "deployment_not_ready"]
    assert 0 <= seen_after <= START_POLL_S
    assert len(waits) == 1  # the same reason all along: said once, not a line per look


UV_SAYS = [
    "(weather_tools) Creating virtual environment with seed packages at: /venvs/.venv",
    "(weather_tools) error: Failed to install seed packages into virtual environment",
    "(weather_tools)   cause: No solution found when resolving: `pip`",
    "(weather_tools)   cause: Failed to fetch: http://127.0.0.1:9/simple/pip/",
    "(weather_tools)   cause: Connection refused (os error 111)",
    *(f"Traceback line {n}" for n in range(40)),  # what Gym prints after, far longer
]


async def test_the_first_index_failure_gym_prints_is_kept_past_the_tail() -> None:
    output = OutputTail("gym", lines=5, remember=INDEX_UNREACHABLE)
    sent, received = trio.testing.memory_stream_pair()
    await sent.send_all("".join(f"{line}\n" for line in UV_SAYS).encode())
    await sent.aclose()
    await output.pump("output", received)
    assert "Failed to fetch" not in output.text()  # long gone from the tail
    assert output.remembered is not None
    assert output.remembered["server"] == "weather_tools"
    assert output.remembered["url"] == "http://127.0.0.1:9/simple/pip/"


@pytest.mark.parametrize(
    ("env", "advice"),
    [
        ({"UV_FIND_LINKS": "/w"}, "if the wheelhouse on UV_FIND_LINKS (the environment package's)"),
        ({}, "make the index reachable, or give a wheelhouse that is a complete closure"),
    ],
    ids=["wheelhouse", "none"],
)
def test_an_unreachable_index_is_one_line_naming_it_the_server_and_the_switch(
    env: dict[str, str], advice: str
) -> None:
    found = INDEX_UNREACHABLE.search(UV_SAYS[3])
    cause = index_unreachable(found, env)
    assert "\n" not in cause
    assert "server weather_tools's venv" in cause
    assert "(http://127.0.0.1:9/simple/pip/)" in cause
    assert advice in cause and "NMP_ENVIRONMENT_OFFLINE=1" in cause
    # Offline, uv asks no index: whatever it printed is not this.
    assert index_unreachable(found, {**env, "UV_OFFLINE": "1"}) == ""
    assert index_unreachable(None, env) == ""
