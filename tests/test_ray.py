"""The Ray actor (NeMo RL's shape) on a real single-node Ray cluster (``trio_gym[ray]``;
``.ci/run`` installs it, the default run skips without it).

One cluster for the module: it takes seconds to start and ~0.8 GB. It gets a temp dir of its own
(other clusters may share the machine) and ends with ``ray.shutdown()`` only. Driver code is
synchronous, as a trainer's is; the real clock."""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.fleet import uninterrupted
from tests.processes import kill_all, processes_with
from trio_gym.fleet import HostSpec
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.pool import HostPool
from trio_gym.trainer.scheduler import SchedulerSettings

ray = pytest.importorskip("ray", reason="Ray: pip install 'trio-gym[ray]' (.ci/run installs it)")

from trio_gym.fleet.ray_actor import remote_actor  # noqa: E402
from trio_gym.fleet.ray_hosts import RayProvider  # noqa: E402
from trio_gym.trainer.errors import RolloutError  # noqa: E402

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parent.parent
TOKEN_VARIABLE = "TRIO_GYM_RAY_TEST"
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A single-node cluster whose workers (and the hosts they start) carry a token."""
    token = uuid.uuid4().hex
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), TOKEN_VARIABLE: token}},
    )
    try:
        yield token
    finally:
        ray.shutdown()
        kill_all(TOKEN_VARIABLE, token)


class Record:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.touch()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines()]

    def until(self, condition: Any) -> list[dict[str, Any]]:
        deadline = time.monotonic() + WAIT_S  # clock-ok: driver code waiting on other processes
        while not condition(lines := self.lines()):
            assert time.monotonic() < deadline, lines  # clock-ok: as above
            time.sleep(0.05)  # clock-ok: as above
        return lines


def spinup_config(record: Path, hosts: int = 2) -> dict[str, Any]:
    host_env = {"NMP_RUNNER": "tests.user_runner:recording", "TRIO_GYM_TEST_RECORD": str(record)}
    return {"hosts": hosts, "caller": {"host_env": host_env, "work_path": str(record.parent)}}


def host_processes(token: str) -> list[int]:
    """The trio_gym hosts (and their guards) of this module's cluster; not Ray's own workers."""
    found = []
    for pid in processes_with(TOKEN_VARIABLE, token):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (b"trio_gym" in command and b"serve" in command) or b"guard.py" in command:
            found.append(pid)
    return found


def test_rows_stream_back_in_completion_order_with_their_index_and_timing(
    cluster: str, tmp_path: Path
) -> None:
    actor = remote_actor().remote()
    descriptor = ray.get(actor.spinup.remote(spinup_config(tmp_path / "record.jsonl")))
    assert [host["name"] for host in descriptor["hosts"]] == ["local-0", "local-1"]
    assert ray.get(actor.health_check.remote()) is True
    rows = [{"id": i, "sleep_s": 1.0 if i % 2 == 0 else 0.05} for i in range(8)]
    answered = [
        ray.get(ref) for ref in actor.run_rollouts.options(num_returns="streaming").remote(rows)
    ]
    assert sorted(index for index, _, _ in answered) == list(range(8))
    assert {index for index, _, _ in answered[:4]} == {1, 3, 5, 7}  # the quick ones first
    for index, result, timing in answered:
        assert result["id"] == index
        assert timing["host"] in {"local-0", "local-1"} and timing["elapsed_s"] > 0
    ray.get(actor.shutdown.remote())
    assert ray.get(actor.health_check.remote()) is False
    assert host_processes(cluster) == []
    ray.kill(actor)


def test_cancelling_the_consumer_cancels_every_running_example(
    cluster: str, tmp_path: Path
) -> None:
    record = Record(tmp_path / "record.jsonl")
    actor = remote_actor().remote()
    ray.get(actor.spinup.remote(spinup_config(record.path)))
    rows = [{"id": i, "sleep_s": 300} for i in range(6)]
    stream = actor.run_rollouts.options(num_returns="streaming").remote(rows)
    record.until(lambda lines: len(lines) == 6)  # every example is running on a host
    ray.cancel(stream)
    lines = record.until(lambda lines: sum(bool(line.get("cancelled")) for line in lines) == 6)
    assert collections.Counter(line["id"] for line in lines) == dict.fromkeys(range(6), 2)
    # The session carries on: the next batch runs.
    again = [
        ray.get(ref)
        for ref in actor.run_rollouts.options(num_returns="streaming").remote([{"id": 9}])
    ]
    assert [(index, result["id"]) for index, result, _ in again] == [(0, 9)]
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def test_a_killed_actor_takes_its_hosts_with_it(cluster: str, tmp_path: Path) -> None:
    actor = remote_actor().remote()
    ray.get(actor.spinup.remote(spinup_config(tmp_path / "record.jsonl")))
    assert len(host_processes(cluster)) == 4  # two hosts, each under its guard
    ray.kill(actor)
    deadline = time.monotonic() + WAIT_S  # clock-ok: driver code waiting on other processes
    while host_processes(cluster):
        assert time.monotonic() < deadline  # clock-ok: as above
        time.sleep(0.05)  # clock-ok: as above


def test_the_actor_runs_one_session_and_refuses_bad_config(cluster: str, tmp_path: Path) -> None:
    actor = remote_actor().remote()
    with pytest.raises(ray.exceptions.RayTaskError, match=r"spinup: .*unknown_key"):
        ray.get(actor.spinup.remote({"unknown_key": 1}))
    ray.get(actor.spinup.remote(spinup_config(tmp_path / "record.jsonl", hosts=1)))
    with pytest.raises(ray.exceptions.RayTaskError, match="not restartable"):
        ray.get(actor.spinup.remote(spinup_config(tmp_path / "record.jsonl", hosts=1)))
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


def test_a_failed_row_is_yielded_with_its_error_not_dropped(cluster: str, tmp_path: Path) -> None:
    actor = remote_actor().remote()
    config = spinup_config(tmp_path / "record.jsonl", hosts=1)
    config["caller"]["rollout_deadline_s"] = 1.0  # the host ends a slower row's batch
    ray.get(actor.spinup.remote(config))
    rows = [{"id": 0}, {"id": 1, "sleep_s": 30}]
    answered = sorted(
        ray.get(ref) for ref in actor.run_rollouts.options(num_returns="streaming").remote(rows)
    )
    assert [index for index, _, _ in answered] == [0, 1]
    assert answered[0][1]["id"] == 0
    error = answered[1][1]
    assert isinstance(error, RolloutError) and error.code == "deadline_exceeded"
    # Lost to the host's deadline on every attempt, then failed, naming the last cause.
    assert "lost its row 3 times (max_losses=3)" in error.message
    assert "outlived its deadline of 1 s" in error.message
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


async def test_the_ray_provider_places_hosts_on_the_cluster_and_stops_them(
    cluster: str, tmp_path: Path
) -> None:
    record = Record(tmp_path / "record.jsonl")
    environment = {
        "NMP_RUNNER": "tests.user_runner:recording",
        "TRIO_GYM_TEST_RECORD": str(record.path),
    }
    spec = HostSpec(environment, stop_grace_s=2.0, ready_timeout_s=WAIT_S)
    provider = RayProvider(cpus_per_host=0.25)
    with trio.fail_after(2 * WAIT_S):
        async with provider.hosts(2, spec) as handles:
            assert [handle.name for handle in handles] == ["ray-0", "ray-1"]
            (node,) = ray.nodes()  # hosts listen where the cluster knows their node
            address = node["NodeManagerAddress"]
            assert all(handle.url.startswith(f"http://{address}:") for handle in handles)
            assert len(await trio.to_thread.run_sync(host_processes, cluster)) == 4
            settings = SchedulerSettings(per_host_in_flight=1)
            chunks = ClientSettings(chunk_size=1)
            async with HostPool(
                handles, settings, client_settings=chunks, launcher=provider
            ) as pool:
                results = await pool.run([{"id": i, "sleep_s": 0.2} for i in range(4)])
            assert len({result["pid"] for result in results}) == 2
            # A replacement takes the old host's bundle once the old host is stopped.
            replacement = await provider.replace(handles[0])
            assert replacement.name == "ray-2" and await provider.alive(replacement)
            assert not await provider.alive(handles[0])
            assert len(await trio.to_thread.run_sync(host_processes, cluster)) == 4
    assert await trio.to_thread.run_sync(host_processes, cluster) == []
    states = {group["state"] for group in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}


def test_the_actor_spreads_its_hosts_over_the_cluster_with_launch_ray(
    cluster: str, tmp_path: Path
) -> None:
    actor = remote_actor().remote()
    config = {**spinup_config(tmp_path / "record.jsonl"), "launch": "ray", "cpus_per_host": 0.25}
    descriptor = ray.get(actor.spinup.remote(config))
    assert [host["name"] for host in descriptor["hosts"]] == ["ray-0", "ray-1"]
    rows = [{"id": i} for i in range(4)]
    stream = actor.run_rollouts.options(num_returns="streaming").remote(rows)
    assert sorted(ray.get(ref)[0] for ref in stream) == [0, 1, 2, 3]
    ray.get(actor.shutdown.remote())
    assert host_processes(cluster) == []
    ray.kill(actor)


def test_a_killed_actor_takes_the_hosts_it_spread_over_the_cluster_with_it(
    cluster: str, tmp_path: Path
) -> None:
    actor = remote_actor().remote()
    config = {**spinup_config(tmp_path / "record.jsonl"), "launch": "ray", "cpus_per_host": 0.25}
    ray.get(actor.spinup.remote(config))
    assert len(host_processes(cluster)) == 4
    ray.kill(actor)  # its owner actors share its fate, and each host its owner's
    deadline = time.monotonic() + WAIT_S  # clock-ok: driver code waiting on other processes
    while host_processes(cluster):
        assert time.monotonic() < deadline  # clock-ok: as above
        time.sleep(0.05)  # clock-ok: as above


def test_the_actor_checkpoints_mid_flight_and_a_new_actor_restores_each_row_once(
    cluster: str, tmp_path: Path
) -> None:
    """NeMo RL's actor plus checkpoint/restore: a cut taken while rows run; a new actor
    restores it and yields exactly the rows the first had not yielded before the cut, the
    parked episodes continuing where they were."""
    rows = [{"seed": i, "meetings": 4, "think_s": 1.0} for i in range(6)]
    config = {"hosts": 2, "caller": {"work_path": str(tmp_path)}}
    first = remote_actor().remote()
    ray.get(first.spinup.remote(config))
    stream = first.run_rollouts.options(num_returns="streaming").remote(rows)
    answered: list[Any] = []
    consumer = threading.Thread(target=lambda: answered.extend(ray.get(ref) for ref in stream))
    consumer.start()
    time.sleep(2.5)  # clock-ok: driver code; every episode is in its third step
    taken = ray.get(first.checkpoint.remote(str(tmp_path / "ckpt")))
    consumer.join()
    ray.get(first.shutdown.remote())
    ray.kill(first)
    assert taken["exported"] >= 1 and len(taken["calls"]) == 1

    second = remote_actor().remote()
    ray.get(second.spinup.remote(config))
    restored = ray.get(second.restore.remote(str(tmp_path / "ckpt")))
    (call,) = restored["calls"]
    assert call["call_id"] == taken["calls"][0] and call["rows"] == rows
    resumed = [
        ray.get(ref)
        for ref in second.run_rollouts.options(num_returns="streaming").remote(
            None, call_id=call["call_id"]
        )
    ]
    # A new call after the restore is its own (found in review: it took the restored call's
    # id, and with it the restored call's groups).
    other = [{"seed": 100 + i, "meetings": 1, "think_s": 0.1} for i in range(3)]
    fresh: list[Any] = []
    new_call = second.run_rollouts.options(num_returns="streaming").remote(other)
    reader = threading.Thread(target=lambda: fresh.extend(ray.get(ref) for ref in new_call))
    reader.start()
    reader.join(timeout=WAIT_S)
    ray.get(second.shutdown.remote())
    reader.join(timeout=WAIT_S)  # a stream that hung ends with the session
    ray.kill(second)
    again = [index for index, _, _ in resumed]
    assert sorted(call["delivered"] + again) == list(range(6))  # each row once across the cut
    continued = [timing for _, _, timing in resumed if timing["attempt"] == 1]
    assert len(continued) == restored["restored"] >= 1  # parked, then continued as attempt 1
    for index, result, _ in resumed:  # side effects as one uninterrupted run's, once
        expected = trio.run(uninterrupted, rows[index])
        assert result["booked"] == expected["booked"] and result["seed"] == index
    assert sorted(result["seed"] for _, result, _ in fresh) == [100, 101, 102]
    assert host_processes(cluster) == []
