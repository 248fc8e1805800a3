"""The OpenSandbox provider through the real ``opensandbox`` SDK, against a fake of the
OpenSandbox server whose sandboxes are local processes (``tests/fake_opensandbox.py``; no
Docker daemon is reachable here, so a real server cannot run — NOTES.md says what only one can
show). Real processes and sockets: the real clock."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.processes import HANG_GUARD_S, kill_all, processes_with
from trio_gym.fleet import HostSpec, LaunchFailed, Mount
from trio_gym.http import Endpoint, HttpLimits, exchange
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.pool import HostPool

pytest.importorskip(
    "opensandbox", reason="the OpenSandbox SDK: pip install 'trio-gym[opensandbox]'"
)

from trio_gym.fleet.opensandbox import LAUNCH_KEY, OpenSandboxProvider

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "fake-api-key-0123456789"
TOKEN_VARIABLE = "TRIO_GYM_SANDBOX_TEST"


class FakeServer:
    """The fake OpenSandbox server of one test, and what its sandboxes left behind."""

    def __init__(self, port: int, token: str, record: Path) -> None:
        self.domain = f"127.0.0.1:{port}"
        self.token = token
        self.record = record

    def provider(self, **settings: Any) -> OpenSandboxProvider:
        return OpenSandboxProvider(
            image="trio-gym:test",
            entrypoint=["bash", str(ROOT / "scripts" / "gym_host.sh"), sys.executable],
            domain=self.domain,
            api_key=API_KEY,
            poll_interval_s=0.1,
            # The fake publishes each host's port as `docker -P` would: a network of its own.
            host_network=False,
            **settings,
        )

    def spec(self, runner: str = "tests.user_runner:recording", **fields: Any) -> HostSpec:
        environment = {
            "NMP_RUNNER": runner,
            "TRIO_GYM_TEST_RECORD": str(self.record),
            TOKEN_VARIABLE: self.token,
        }
        return HostSpec(environment, **{"ready_timeout_s": 30.0, **fields})

    async def call(self, method: str, path: str) -> Any:
        response = await exchange(
            Endpoint.parse(f"http://{self.domain}"),
            method,
            path,
            limits=HttpLimits(),
            max_response_bytes=1 << 20,
            idle_timeout_s=30,
        )
        return json.loads(response.body) if response.body else None

    async def sandboxes(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = await self.call("GET", "/_fake/sandboxes")
        return found

    def left_behind(self) -> list[int]:
        """Live processes of this test's sandboxes (the fake server itself not counted)."""
        return [pid for pid in processes_with(TOKEN_VARIABLE, self.token) if pid != self.pid]

    pid = 0


@pytest.fixture
async def fake(tmp_path: Path) -> AsyncIterator[FakeServer]:
    port_file = tmp_path / "fake.port"
    token = uuid.uuid4().hex
    server = await trio.lowlevel.open_process(
        [
            *(sys.executable, "-m", "tests.fake_opensandbox"),
            *("--port-file", str(port_file), "--api-key", API_KEY),
        ],
        cwd=ROOT,
        env={**os.environ, TOKEN_VARIABLE: token},
    )
    try:
        with trio.fail_after(HANG_GUARD_S):
            while not port_file.exists():  # noqa: ASYNC110 (another process writes the file)
                await trio.sleep(0.01)
        record = tmp_path / "record.jsonl"
        record.touch()
        made = FakeServer(int(port_file.read_text()), token, record)
        made.pid = server.pid
        yield made
    finally:
        server.terminate()
        with trio.move_on_after(30):
            await server.wait()
        kill_all(TOKEN_VARIABLE, token)


async def test_hosts_run_in_sandboxes_and_are_killed_when_the_block_ends(
    fake: FakeServer,
) -> None:
    mounts = [Mount("/srv/gym", "/opt/gym"), Mount.same_path("/srv/out", read_only=False)]
    provider = fake.provider(mounts=mounts)
    with trio.fail_after(HANG_GUARD_S):
        async with provider.hosts(2, fake.spec()) as handles:
            assert [handle.name for handle in handles] == ["sandbox-0", "sandbox-1"]
            for handle in handles:
                sandbox = provider.sandbox_id(handle)
                # The endpoint's own headers, and the API key for the server's proxy route.
                expected = {"X-Fake-Sandbox": sandbox, "OPEN-SANDBOX-API-KEY": API_KEY}
                assert dict(handle.headers) == expected
                assert await provider.alive(handle)
            async with HostPool(handles, client_settings=ClientSettings(chunk_size=2)) as pool:
                results = await pool.run([{"id": i, "sleep_s": 0.05} for i in range(8)])
            assert [result["id"] for result in results] == list(range(8))
            assert len({result["pid"] for result in results}) == 2
    sandboxes = await fake.sandboxes()
    assert [(s["status"]["state"], s["status"]["reason"]) for s in sandboxes] == [
        ("Terminated", "killed")
    ] * 2
    for sandbox in sandboxes:
        request = sandbox["request"]
        assert request["image"]["uri"] == "trio-gym:test"
        assert request["env"]["NMP_RUNTIME_HTTP_PORT"] == "8080"
        assert request["timeout"] == 14400
        assert set(request["metadata"]) == {LAUNCH_KEY, "trio-gym-host"}
        assert request["volumes"] == [
            {"name": "mount-0", "host": {"path": "/srv/gym"}, "mountPath": "/opt/gym",
             "readOnly": True},
            {"name": "mount-1", "host": {"path": "/srv/out"}, "mountPath": "/srv/out",
             "readOnly": False},
        ]  # fmt: skip
        # The platform's credential never reaches the sandbox.
        assert not any(API_KEY in value for value in request["env"].values())
        assert not any(name.startswith("OPEN_SANDBOX") for name in request["env"])
    assert fake.left_behind() == []


async def test_the_ttl_is_renewed_at_half_its_length(fake: FakeServer) -> None:
    with trio.fail_after(HANG_GUARD_S):
        async with fake.provider(ttl_s=1.0).hosts(1, fake.spec()) as handles:
            await trio.sleep(2.6)  # past two TTLs: without renewals the fake expires it
            async with HostPool(handles) as pool:
                assert len(await pool.run([{"id": 0}])) == 1
    (sandbox,) = await fake.sandboxes()
    assert sandbox["renewals"] >= 4
    assert sandbox["status"]["reason"] == "killed"


async def test_a_create_whose_answer_was_lost_is_rolled_back_and_tried_again(
    fake: FakeServer,
) -> None:
    await fake.call("POST", "/_fake/lose-next-create")
    with trio.fail_after(HANG_GUARD_S):
        async with fake.provider().hosts(1, fake.spec()) as handles:
            lost, kept = await fake.sandboxes()
            assert lost["status"] == {"state": "Terminated", "reason": "killed"}
            assert kept["status"]["state"] == "Running"
            assert lost["metadata"][LAUNCH_KEY] != kept["metadata"][LAUNCH_KEY]
            async with HostPool(handles) as pool:
                assert len(await pool.run([{"id": 0}])) == 1
    assert fake.left_behind() == []


async def test_credentials_in_the_hosts_environment_are_refused_before_anything_is_created(
    fake: FakeServer,
) -> None:
    spec = fake.spec()
    for name in ("OPEN_SANDBOX_API_KEY", "OPENSANDBOX_TOKEN", "RAY_ADDRESS"):
        leaky = HostSpec({**spec.environment, name: "x"})
        with pytest.raises(ValueError, match=f"must not carry {name}: a sandbox's code can read"):
            async with fake.provider().hosts(1, leaky):
                raise AssertionError("launched")
    assert await fake.sandboxes() == []


async def test_a_sandbox_whose_host_fails_to_start_fails_the_launch_and_is_killed(
    fake: FakeServer,
) -> None:
    with trio.fail_after(HANG_GUARD_S), pytest.raises(LaunchFailed) as failed:
        async with fake.provider().hosts(1, fake.spec("tests.user_runner:failing_start")):
            raise AssertionError("launched")
    assert "host sandbox-0 failed to start: HTTP 503 failed at stage starting_runner" in str(
        failed.value
    )
    (sandbox,) = await fake.sandboxes()
    assert sandbox["status"] == {"state": "Terminated", "reason": "killed"}
    assert fake.left_behind() == []
