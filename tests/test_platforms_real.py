"""Hosts launched on real sandbox platforms: a real Docker daemon (no bridge: every address is
loopback) and a real opensandbox-server 1.1.1 on it, every OpenSandbox call through the server's
own proxy (``tests/platforms.py``); without them the suite is skipped, saying so. Real processes and
sockets: the real clock.

Each test counts what it leaves behind: no container, no sandbox."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.platforms import (
    DOCKER,
    IMAGE,
    containers,
    docker,
    live_sandboxes,
    needs_docker,
    needs_opensandbox,
    opensandbox_provider,
    sandbox_containers,
)
from trio_gym.fleet import DockerProvider, HostSpec, LaunchFailed
from trio_gym.fleet.docker import LAUNCH_LABEL, OWNER_LABEL
from trio_gym.trainer import RolloutClient, RolloutError
from trio_gym.trainer.errors import Origin, Reach
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.hosts import HostHandle
from trio_gym.trainer.pool import HostPool
from trio_gym.trainer.scheduler import SchedulerSettings

pytestmark = pytest.mark.platform


HANG_GUARD_S = 300


def listening_on(port: int) -> set[str]:
    """The addresses something listens on at ``port`` on this machine's network (the one
    host-networked containers share): read from the kernel, no packet sent."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, _, hex_port = local.partition(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def examples(count: int, think_s: float) -> list[dict[str, Any]]:
    return [
        {"seed": index, "meetings": 2, "think_s": think_s, "_ng_task_index": index}
        for index in range(count)
    ]


def spec(**fields: Any) -> HostSpec:
    return HostSpec({}, ("--heartbeat-interval", "0.5"), **{"ready_timeout_s": 60.0, **fields})


@pytest.fixture
def no_containers_left() -> Iterator[None]:
    """No container of ours (a provider's, a sandbox's) outlives the test that made it."""
    ours = (f"label={LAUNCH_LABEL}", "label=opensandbox.io/id")
    before = {c for label in ours for c in containers(label)}
    yield
    left = {c for label in ours for c in containers(label)} - before
    assert not left, f"containers left behind: {left}"


def pool_over(handles: list[HostHandle], provider: Any) -> HostPool:
    # Many failures allowed: the provider saying the container is gone is what ejects.
    return HostPool(
        handles,
        SchedulerSettings(per_host_in_flight=2, probe_interval_s=0.5, max_host_failures=50),
        client_settings=ClientSettings(chunk_size=2),
        launcher=provider,
    )


async def serve_lose_one_and_serve_again(
    pool: HostPool, victim: HostHandle, victim_containers: list[str]
) -> None:
    """A batch; a batch during which ``victim``'s container is killed (only what it had taken
    fails, named); it is replaced; a batch again."""
    first = await pool.run(examples(12, think_s=0.05))
    assert [r["_ng_task_index"] for r in first] == list(range(12))
    async with trio.open_nursery() as nursery:

        async def kill_later() -> None:
            await trio.sleep(1.5)
            await trio.run_process(["docker", "--host", DOCKER, "kill", *victim_containers])

        nursery.start_soon(kill_later)
        outcomes = await pool.outcomes(examples(40, think_s=0.5))
    assert_only_the_killed_hosts_taken_chunks_failed(outcomes, victim.name, most=4)
    # Ejected and replaced: three hosts again, the victim not among them.
    assert len(pool.hosts) == 3 and victim not in pool.hosts
    assert len(await pool.run(examples(12, think_s=0.05))) == 12


def assert_only_the_killed_hosts_taken_chunks_failed(
    outcomes: list[Any], killed: str, *, most: int
) -> list[RolloutError]:
    failures = [outcome for outcome in outcomes if isinstance(outcome, RolloutError)]
    for failure in failures:
        assert f"on host {killed}" in failure.message, failure.message
        assert (failure.origin, failure.reach) == (Origin.SANDBOX, Reach.TAKEN), failure
        assert "the host is gone" in failure.message
    assert 0 < len(failures) <= most
    for index, outcome in enumerate(outcomes):
        if not isinstance(outcome, RolloutError):
            assert outcome["_ng_task_index"] == index
    return failures


# --- Docker -------------------------------------------------------------------------------


@needs_docker
async def test_docker_hosts_serve_survive_a_killed_container_and_leave_nothing(
    no_containers_left: None,
) -> None:
    provider = DockerProvider(image=IMAGE, docker_host=DOCKER, poll_interval_s=0.2)
    with trio.fail_after(HANG_GUARD_S):
        async with (
            provider.hosts(3, spec(stop_grace_s=2)) as handles,
            pool_over(handles, provider) as pool,
        ):
            assert len(containers(f"label={LAUNCH_LABEL}={provider.launch_id}")) == 3
            assert all(h.url.startswith("http://127.0.0.1:") for h in handles)
            assert len({h.url for h in handles}) == 3  # one port each on the shared network
            for handle in handles:  # none on the machine's other interfaces
                assert listening_on(port_of(handle.url)) == {"127.0.0.1"}
            victim = handles[0]
            victim_container = provider.container_id(victim)
            assert victim_container is not None
            await serve_lose_one_and_serve_again(pool, victim, [victim_container])
    assert containers(f"label={LAUNCH_LABEL}={provider.launch_id}") == []


@needs_docker
async def test_a_docker_hosts_own_start_failure_is_quoted(no_containers_left: None) -> None:
    provider = DockerProvider(image=IMAGE, docker_host=DOCKER, poll_interval_s=0.2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with trio.fail_after(HANG_GUARD_S), pytest.raises(LaunchFailed) as failure:
            async with provider.hosts(1, HostSpec({}, ("--port", str(port)))):
                pass
    assert "Address already in use" in str(failure.value)
    assert f"cannot listen on 127.0.0.1:{port}" in str(failure.value)
    bad_package = HostSpec(
        {"NMP_ENVIRONMENT_PATH": "/nowhere/package", "NMP_ENVIRONMENT_PACKAGE_REQUIRED": "1"}
    )
    with trio.fail_after(HANG_GUARD_S), pytest.raises(LaunchFailed) as failure:
        async with provider.hosts(1, bad_package):
            pass
    assert "/nowhere/package" in str(failure.value)
    assert containers(f"label={LAUNCH_LABEL}={provider.launch_id}") == []


@needs_docker
async def test_containers_of_a_trainer_killed_outright_are_swept_by_the_next(
    no_containers_left: None,
) -> None:
    # A container labelled as a dead trainer's of this machine (a pid that is no process now).
    machine_owner = DockerProvider(image=IMAGE, docker_host=DOCKER)
    from trio_gym.fleet.docker import _machine  # the label's machine part, as a trainer writes it

    orphan = docker(
        "create", "--network", "none", "--label", f"{OWNER_LABEL}={_machine()}/999999999/1", IMAGE
    ).strip()
    elsewhere = docker(
        "create", "--network", "none", "--label", f"{OWNER_LABEL}=another-machine/1/1", IMAGE
    ).strip()
    try:
        swept = await machine_owner.sweep()
        assert orphan[:12] in swept and elsewhere[:12] not in swept  # docker ps: short ids
        assert containers(f"id={orphan}") == []
        assert containers(f"id={elsewhere}") != []
    finally:
        docker("rm", "-f", elsewhere)


# --- OpenSandbox --------------------------------------------------------------------------


@needs_opensandbox
async def test_opensandbox_hosts_serve_through_the_proxy_and_survive_a_killed_container(
    caplog: pytest.LogCaptureFixture,
) -> None:
    provider = opensandbox_provider(ports=range(18180, 18200))
    with trio.fail_after(HANG_GUARD_S):
        async with (
            provider.hosts(3, spec(stop_grace_s=2)) as handles,
            pool_over(handles, provider) as pool,
        ):
            assert len(live_sandboxes()) == 3
            assert all("/proxy/" in h.url for h in handles)
            assert all(dict(h.headers).get("OPEN-SANDBOX-API-KEY") for h in handles)
            ports = [int(h.url.rstrip("/").rsplit("/proxy/", 1)[1].split("/")[0]) for h in handles]
            assert len(set(ports)) == 3  # one port each on the shared network
            for port in ports:  # none on the machine's other interfaces
                assert listening_on(port) == {"127.0.0.1"}
            # Each took a port no other host of the provider held: none had to try again.
            assert not [r for r in caplog.records if r.msg == "sandbox_port_in_use"]
            second = handles[1]
            client = RolloutClient(second.url, headers=second.headers, identity=second.identity)
            async with client.stream(examples(3, 0.05)) as rows:
                assert sorted([row.index async for row in rows]) == [0, 1, 2]
            victim = handles[0]
            sandbox = provider.sandbox_id(victim)
            victim_containers = containers(f"label=opensandbox.io/id={sandbox}")
            assert len(victim_containers) == 1
            await serve_lose_one_and_serve_again(pool, victim, victim_containers)
    with trio.fail_after(60):
        while live_sandboxes() or sandbox_containers():  # noqa: ASYNC110 (the server's state)
            await trio.sleep(0.5)


@needs_opensandbox
async def test_an_opensandbox_hosts_own_start_failure_is_quoted_before_its_log_is_gone() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        provider = opensandbox_provider(ports=[port])
        with trio.fail_after(HANG_GUARD_S), pytest.raises(LaunchFailed) as failure:
            async with provider.hosts(1, spec()):
                pass
    assert "Address already in use" in str(failure.value)
    assert f"cannot listen on 127.0.0.1:{port}" in str(failure.value)
    bad_package = HostSpec(
        {"NMP_ENVIRONMENT_PATH": "/nowhere/package", "NMP_ENVIRONMENT_PACKAGE_REQUIRED": "1"},
        ready_timeout_s=60.0,
    )
    provider = opensandbox_provider(ports=range(18200, 18210))
    with trio.fail_after(HANG_GUARD_S), pytest.raises(LaunchFailed) as failure:
        async with provider.hosts(1, bad_package):
            pass
    assert "/nowhere/package" in str(failure.value)
    with trio.fail_after(60):
        while live_sandboxes() or sandbox_containers():  # noqa: ASYNC110 (the server's state)
            await trio.sleep(0.5)


@needs_opensandbox
async def test_a_port_something_else_holds_is_skipped_for_the_next() -> None:
    with socket.socket() as held, socket.socket() as freed:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        freed.bind(("127.0.0.1", 0))
        free = freed.getsockname()[1]
        freed.close()  # free now, and no one else's to take meanwhile but by chance
        provider = opensandbox_provider(ports=[port, free])
        with trio.fail_after(HANG_GUARD_S):
            async with provider.hosts(1, spec()) as (handle,):
                assert f"/proxy/{free}" in handle.url
                client = RolloutClient(handle.url, headers=handle.headers, identity=handle.identity)
                assert len(await client.run(examples(2, 0.05))) == 2
    with trio.fail_after(60):
        while live_sandboxes() or sandbox_containers():  # noqa: ASYNC110 (the server's state)
            await trio.sleep(0.5)
