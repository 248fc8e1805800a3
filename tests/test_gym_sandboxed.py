"""Real NeMo Gym inside real sandboxes: the host in a container of the platform's image, started
through the project's own providers (Docker, and OpenSandbox with every byte through its
server's proxy), starting the environment package's Gym deployment there, as a sandbox
orchestrator launches it.

The image is the platform suite's (Debian's Python with trio_gym; this checkout's trio_gym is
mounted over the image's, so the hosts run the code under test); Gym's Python — the
environment ``scripts/gym_env.sh`` builds and the interpreter it was built on — is mounted
read-only at the paths it was built at, as an operator's image would carry it (a venv holds
absolute paths; copying 1.5 GB into an image per run would add a minute and prove nothing
more). The package, Gym's per-server venvs (links to that environment) and, where a test asks,
the capture folder are mounted from ``TRIO_GYM_PLATFORM_MOUNTS``, the one directory of the
machine the platform lets sandboxes mount. The model is ``tests/stub_model.py`` on the machine:
the sandboxes share its network (loopback only).

Needs both the platform (``scripts/sandbox_platform.sh``) and real Gym (``scripts/gym_env.sh``);
``.ci/run`` provides both. Real processes and sockets: the real clock.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from tests.packages import build_wheel
from tests.platforms import (
    DOCKER,
    IMAGE,
    MOUNTS,
    containers,
    docker,
    live_sandboxes,
    needs_docker,
    needs_opensandbox,
    opensandbox_provider,
    sandbox_containers,
)
from tests.processes import processes_with
from tests.real_gym import (
    DEPLOYMENT_VARIABLE,
    REPO,
    RealGym,
    by_identity,
    comparable,
    gym_global_config,
    gym_wheelhouse,
    gyms_own_collection,
    prebuilt_venvs,
    row,
    weather_package,
)
from trio_gym.fleet import DockerProvider, HostSpec, LaunchFailed, Mount
from trio_gym.fleet.docker import LAUNCH_LABEL
from trio_gym.trainer import RolloutClient, RolloutError
from trio_gym.trainer.errors import Origin, Reach
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.hosts import HostHandle
from trio_gym.trainer.pool import HostPool
from trio_gym.trainer.scheduler import SchedulerSettings

pytestmark = [pytest.mark.platform, pytest.mark.real_gym]

READY_TIMEOUT_S = 300.0  # Ray and five servers per sandbox, two sandboxes on two shared cores
HANG_GUARD_S = 600
WORK_IN_SANDBOX = "/tmp/trio-gym-work"  # the sandbox's own: never shared between two


@attrs.frozen
class SandboxedGym:
    gym: RealGym
    package: Path
    venvs: Path
    captures: Path
    mounts: tuple[Mount, ...]
    gym_mounts: tuple[Mount, ...]
    """What an operator's image carries: Gym's environment and the Python it was built on; and
    this checkout's trio_gym over the image's (the image was built when the platform started)."""

    def spec(self, *, capture: bool = False, **environment: str) -> HostSpec:
        """Hosts that start the package's Gym deployment (capturing into :attr:`captures`)."""
        config = gym_global_config(
            self.gym.stub.url, self.venvs, self.captures if capture else None
        )
        return HostSpec(
            {
                "NMP_JOB_ID": "sandboxed-gym",
                "NMP_ENVIRONMENT_PATH": str(self.package),
                "NMP_ENVIRONMENT_PACKAGE_REQUIRED": "1",
                "NMP_WORK_PATH": WORK_IN_SANDBOX,
                "NMP_GYM_GLOBAL_CONFIG": json.dumps(config),
                "NMP_GYM_PYTHON": self.gym.python,
                "NMP_GYM_STOP_GRACE_S": "5",
                **environment,
            },
            ("--heartbeat-interval", "1"),
            ready_timeout_s=READY_TIMEOUT_S,
            stop_grace_s=10,
        )


def this_checkouts_code(copy: Path) -> Mount:
    """This checkout's ``trio_gym`` (copied to where sandboxes may mount it), mounted where the
    image has its own: the hosts run the code under test, whenever the image was built."""
    shutil.copytree(REPO / "trio_gym", copy, ignore=shutil.ignore_patterns("__pycache__"))
    installed = docker(
        "run", "--rm", "--network", "none", "--entrypoint", "/opt/venv/bin/python", IMAGE,
        "-c", "import pathlib, trio_gym; print(pathlib.Path(trio_gym.__file__).parent)",
    ).strip()  # fmt: skip
    return Mount(str(copy), installed)


@pytest.fixture(scope="module")
def sandboxed_gym(real_gym: RealGym) -> Iterator[SandboxedGym]:
    if not MOUNTS:
        pytest.skip("no real sandbox platform: .ci/run starts it (scripts/sandbox_platform.sh)")
    root = Path(tempfile.mkdtemp(prefix="gym-", dir=MOUNTS))
    try:
        package = weather_package(root / "environment", real_gym.site)
        venvs = prebuilt_venvs(root / "venvs", real_gym.python)
        captures = root / "captures"
        captures.mkdir(mode=0o777)
        gym_venv = Path(real_gym.python).parent.parent
        base = subprocess.check_output(
            [real_gym.python, "-c", "import sys; print(sys.base_prefix)"], text=True
        ).strip()
        gym_mounts = (
            Mount.same_path(str(gym_venv)),
            Mount.same_path(base),
            this_checkouts_code(root / "trio_gym"),
        )
        mounts = (
            Mount.same_path(str(root)),
            Mount.same_path(str(captures), read_only=False),
            *gym_mounts,
        )
        yield SandboxedGym(real_gym, package, venvs, captures, mounts, gym_mounts)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def docker_provider(mounts: Sequence[Mount]) -> Any:
    # Gym prints every server's output: the cause of a failed start may be far above its end.
    return DockerProvider(
        image=IMAGE, docker_host=DOCKER, mounts=mounts, poll_interval_s=0.2, log_tail_lines=300
    )


def sandbox_provider(mounts: Sequence[Mount]) -> Any:
    return opensandbox_provider(mounts=mounts, ports=range(18300, 18340))


PLATFORMS = [
    pytest.param(docker_provider, id="docker", marks=needs_docker),
    pytest.param(sandbox_provider, id="opensandbox", marks=needs_opensandbox),
]
ProviderFactory = Callable[[Sequence[Mount]], Any]


def ours_left() -> set[str]:
    """Every container of a provider's launch or of a sandbox still on the daemon."""
    return {c for f in (f"label={LAUNCH_LABEL}", "label=opensandbox.io/id") for c in containers(f)}


async def wait_until_gone(what: Callable[[], Any]) -> None:
    with trio.fail_after(60):
        while what():  # noqa: ASYNC110 (another process's state)
            await trio.sleep(0.5)


async def stub_stats(gym: SandboxedGym) -> dict[str, int]:
    return await trio.to_thread.run_sync(gym.gym.stub.stats)


def client_of(handle: HostHandle) -> RolloutClient:
    return RolloutClient(handle.url, headers=handle.headers, identity=handle.identity)


def gym_started(container: str) -> dict[str, Any]:
    """The ``gym_starting`` line of the host in ``container``: where its Gym's head server is
    (``head_server``, host:port) and the tag its processes carry (``deployment``)."""
    log = subprocess.run(
        ["docker", "--host", DOCKER, "logs", container],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    for line in (log.stdout + log.stderr).splitlines():
        if line.startswith("{") and '"gym_starting"' in line:
            started: dict[str, Any] = json.loads(line)
            return started
    raise AssertionError(f"no gym_starting line in {container}'s log")


def gym_processes(*started: dict[str, Any]) -> list[int]:
    """Every live process of these deployments, seen from the machine (each inherits its tag)."""
    return [pid for s in started for pid in processes_with(DEPLOYMENT_VARIABLE, s["deployment"])]


def container_of(provider: Any, handle: HostHandle) -> str:
    if isinstance(provider, DockerProvider):
        container = provider.container_id(handle)
        assert container is not None
        return container
    (container,) = containers(f"label=opensandbox.io/id={provider.sandbox_id(handle)}")
    return container


@pytest.mark.parametrize("make_provider", PLATFORMS)
async def test_a_sandboxed_gym_answers_through_the_platform_as_gyms_own_collection_does(
    make_provider: ProviderFactory, sandboxed_gym: SandboxedGym, tmp_path: Path
) -> None:
    provider = make_provider(sandboxed_gym.mounts)
    rows = [
        row("weather_agent", "what is the weather in sf?", 40),  # rewarded
        row("weather_agent", "weather [no-tool]", 41),  # rewarded 0
        row("weather_agent", "what is the weather in sf? [no-tokens]", 42),  # no token ids
        row("weather_session_agent", "what is the weather in sf?", 44),
    ]
    with trio.fail_after(HANG_GUARD_S):
        async with provider.hosts(1, sandboxed_gym.spec(capture=True)) as (handle,):
            ours = await client_of(handle).run(rows)
            started = gym_started(container_of(provider, handle))
            gyms, failures = await trio.to_thread.run_sync(
                gyms_own_collection,
                sandboxed_gym.gym.python,
                started["head_server"],
                rows,
                tmp_path / "gym.jsonl",
                sandboxed_gym.captures,
            )
    assert not failures
    assert [r["_ng_task_index"] for r in ours] == [40, 41, 42, 44]
    assert comparable(by_identity(ours)) == comparable(by_identity(gyms))
    rewarded = by_identity(ours)[(40, 0)]
    assert rewarded["reward"] == 1.0 and rewarded["mask_sample"] is False
    assert len(rewarded["ng_model_call_capture"]["calls"]) == 2
    await wait_until_gone(ours_left)
    assert not gym_processes(started)


@pytest.mark.parametrize("make_provider", PLATFORMS)
async def test_two_sandboxed_gyms_side_by_side_lose_one_mid_run_and_leave_nothing(
    make_provider: ProviderFactory, sandboxed_gym: SandboxedGym
) -> None:
    """Two deployments on the network the sandboxes share, each answering rows; one sandbox
    killed while both work: only the chunks it had taken fail, named; a replacement starts its
    own Gym and takes work; nothing is left of any of them."""
    provider = make_provider(sandboxed_gym.mounts)
    settings = SchedulerSettings(per_host_in_flight=2, probe_interval_s=0.5, max_host_failures=50)
    with trio.fail_after(HANG_GUARD_S):
        async with (
            provider.hosts(2, sandboxed_gym.spec()) as handles,
            HostPool(
                handles, settings, client_settings=ClientSettings(chunk_size=2), launcher=provider
            ) as pool,
        ):
            started = [gym_started(container_of(provider, h)) for h in handles]
            assert len({s["head_server"] for s in started}) == 2  # a head server each
            for deployment in started:  # each its own: launcher, Ray, five servers
                assert len(gym_processes(deployment)) >= 7
            for index, handle in enumerate(handles):
                answered = await client_of(handle).run([row("weather_agent", "sf?", index)])
                assert answered[0]["reward"] == 1.0
            victim = handles[0]
            victim_container = container_of(provider, victim)
            slow = [row("weather_agent", "weather in sf? [slow 1]", i) for i in range(16)]
            async with trio.open_nursery() as nursery:

                async def kill_later() -> None:
                    await trio.sleep(1.5)
                    kill = ["docker", "--host", DOCKER, "kill", victim_container]
                    await trio.run_process(kill, capture_stdout=True)

                calls_before = (await stub_stats(sandboxed_gym))["calls"]
                nursery.start_soon(kill_later)
                outcomes = await pool.outcomes(slow)
            failures = [o for o in outcomes if isinstance(o, RolloutError)]
            assert 0 < len(failures) <= 2 * 2  # at most its two chunks in flight
            for failure in failures:
                assert f"on host {victim.name}" in failure.message, failure.message
                assert (failure.origin, failure.reach) == (Origin.SANDBOX, Reach.TAKEN), failure
            for index, outcome in enumerate(outcomes):
                if not isinstance(outcome, RolloutError):
                    assert outcome["_ng_task_index"] == index
            # Nothing ran twice: a row makes two model calls, and no row was sent again.
            assert (await stub_stats(sandboxed_gym))["calls"] - calls_before <= 2 * len(slow)
            # The pool ejected the dead sandbox and launched a replacement, which serves.
            heir = await pool.scheduler.until_lost(victim.name)
            assert heir is not None and len(pool.hosts) == 2 and victim not in pool.hosts
            (replacement,) = [h for h in pool.hosts if h.name == heir]
            started.append(gym_started(container_of(provider, replacement)))
            again = await pool.run([row("weather_agent", "sf?", i) for i in range(8)])
            assert [r["_ng_task_index"] for r in again] == list(range(8))
    await wait_until_gone(ours_left)
    assert not gym_processes(*started)  # Ray's included: the sandbox's end is theirs
    if make_provider is sandbox_provider:
        await wait_until_gone(live_sandboxes)
        assert not sandbox_containers()


# --- offline: the package's servers' venvs built in the sandbox from wheelhouses alone --------

SERVER = "resources_servers/example_single_tool_call"


@attrs.frozen
class OfflineSetup:
    spec: HostSpec
    mounts: tuple[Mount, ...]
    venvs: Path
    index: str
    """The index the environment names: a loopback port nothing listens on."""


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port  # closed now: a connection to it is refused


def offline_setup(sandboxed: SandboxedGym, root: Path, *, offline: bool) -> OfflineSetup:
    """A wheels-v1 package whose resources server needs a venv built at start (no prebuilt
    one) from its requirements, which name the package's own wheel — which its app imports;
    the operator's wheelhouse of nemo-gym's closure on ``UV_FIND_LINKS``; an index named and
    unreachable."""
    gym = sandboxed.gym
    wheelhouse = gym_wheelhouse(gym.python)
    if wheelhouse is None:
        pytest.skip("nemo-gym's wheelhouse is not downloaded here: run scripts/gym_env.sh")
    package = weather_package(root / "environment", gym.site)
    manifest = package / "nemo-environment.yaml"
    manifest.write_text(manifest.read_text().replace("native-v1", "wheels-v1"))
    build_wheel(package / "wheels", "weather-units", "1.0.0", {"weather_units.py": "UNIT = 'C'\n"})
    server = package / SERVER
    requirements = server / "requirements.txt"
    requirements.write_text(requirements.read_text() + "weather-units==1.0.0\n")
    app = server / "app.py"
    app.write_text("import weather_units  # noqa: F401 (the package's wheel)\n" + app.read_text())
    venvs = prebuilt_venvs(root / "venvs", gym.python, leave_out=(SERVER,))
    # nemo-gym 0.7.0 declares Python >= 3.13.14 and this machine's is 3.13.0 (where it runs):
    # uv is told so, as pip is told with --ignore-requires-python when the environment is built.
    uv_config = root / "uv.toml"
    uv_config.write_text('[pip]\npython-version = "3.13.14"\n')
    index = f"http://127.0.0.1:{closed_port()}/simple"
    config = gym_global_config(gym.stub.url, venvs)
    spec = sandboxed.spec(
        NMP_ENVIRONMENT_PATH=str(package),
        NMP_GYM_GLOBAL_CONFIG=json.dumps(config),
        UV_INDEX_URL=index,
        UV_FIND_LINKS=str(wheelhouse),
        UV_CONFIG_FILE=str(uv_config),
        UV_PYTHON_DOWNLOADS="never",
        **({"NMP_ENVIRONMENT_OFFLINE": "1"} if offline else {}),
    )
    mounts = (
        Mount.same_path(str(root), read_only=False),  # Gym builds the server's venv into it
        Mount.same_path(str(wheelhouse)),
        *sandboxed.gym_mounts,
    )
    return OfflineSetup(spec, mounts, venvs, index)


@pytest.fixture
def offline_root(sandboxed_gym: SandboxedGym) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="offline-", dir=MOUNTS))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("make_provider", PLATFORMS)
async def test_offline_a_packages_server_venv_is_built_in_the_sandbox_from_wheelhouses_alone(
    make_provider: ProviderFactory, sandboxed_gym: SandboxedGym, offline_root: Path
) -> None:
    setup = offline_setup(sandboxed_gym, offline_root, offline=True)
    provider = make_provider(setup.mounts)
    with trio.fail_after(HANG_GUARD_S):
        async with provider.hosts(1, setup.spec) as (handle,):
            answered = await client_of(handle).run([row("weather_agent", "sf?", 0)])
    assert answered[0]["reward"] == 1.0
    # Built here, in the sandbox, not a link to a prebuilt one: with the package's wheel in it.
    venv = setup.venvs / SERVER / ".venv"
    assert not venv.is_symlink()
    assert list(venv.glob("lib/python3.13/site-packages/weather_units-1.0.0.dist-info"))
    assert list(venv.glob("lib/python3.13/site-packages/nemo_gym-0.7.0.dist-info"))
    await wait_until_gone(ours_left)


@pytest.mark.parametrize("make_provider", PLATFORMS)
async def test_without_offline_the_unreachable_index_fails_the_start_naming_it_and_the_switch(
    make_provider: ProviderFactory, sandboxed_gym: SandboxedGym, offline_root: Path
) -> None:
    setup = offline_setup(sandboxed_gym, offline_root, offline=False)
    provider = make_provider(setup.mounts)
    with trio.fail_after(HANG_GUARD_S), pytest.raises(LaunchFailed) as failed:
        async with provider.hosts(1, setup.spec):
            pass
    said = str(failed.value)
    cause = said.split("failed to start: ", 1)[1].splitlines()[0]
    assert f"could not reach the package index ({setup.index}/" in cause, said
    assert "turn environment_offline on (NMP_ENVIRONMENT_OFFLINE=1" in cause, said
    await wait_until_gone(ours_left)
