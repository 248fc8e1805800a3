"""The local provider and the host pool against real host processes, with faults injected: a
host SIGKILLed or stalled mid-batch, a host answering 503, hosts that never become ready.

Real processes and sockets, so the real clock. Every test counts the processes its hosts left
behind (none may outlive the provider's block) and how often each example ran (the record file
the hosts' runner appends to as each example starts)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.processes import HANG_GUARD_S
from tests.recorded import TOKEN_VARIABLE, Hosts, assert_each_ran_once, examples
from trio_gym.fleet import HostHandle, HostSpec, LaunchFailed, LocalProvider
from trio_gym.trainer import RolloutClient, RolloutError
from trio_gym.trainer.errors import Origin
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.hosts import HealthStatus, probe
from trio_gym.trainer.pool import HostPool
from trio_gym.trainer.scheduler import SchedulerSettings


async def run_and_signal_the_first_host(
    pool: HostPool, hosts: Hosts, batch: list[dict[str, Any]], signum: int
) -> tuple[list[Any], int]:
    """Run ``batch``; as soon as a host has started an example of it, send that host
    ``signum``. The outcomes, and the pid signalled."""
    signalled: list[int] = []

    async def signal_the_first_host() -> None:
        signalled.append(await hosts.first_host_to_run())
        os.kill(signalled[0], signum)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(signal_the_first_host)
        outcomes = await pool.outcomes(batch)
    return outcomes, signalled[0]


async def eventually(condition: Callable[[], object]) -> None:
    while not condition():  # noqa: ASYNC110 (the pool's own tasks, on real processes)
        await trio.sleep(0.02)


async def test_a_host_killed_mid_batch_fails_only_what_it_had_taken_and_is_replaced(
    hosts: Hosts, caplog: pytest.LogCaptureFixture
) -> None:
    provider = LocalProvider()
    with trio.fail_after(HANG_GUARD_S):
        async with (
            provider.hosts(3, hosts.spec()) as handles,
            HostPool(
                handles,
                # Probes alone would take 50 failures: the provider saying its process is gone
                # ejects it at once.
                SchedulerSettings(per_host_in_flight=1, probe_interval_s=0.5, max_host_failures=50),
                client_settings=ClientSettings(chunk_size=2, idle_timeout_s=5),
                launcher=provider,
            ) as pool,
        ):
            outcomes, killed = await run_and_signal_the_first_host(
                pool, hosts, examples(24, sleep_s=0.3), signal.SIGKILL
            )
            taken_by_the_dead = {run["id"] for run in hosts.runs() if run["pid"] == killed}
            failed = {i for i, outcome in enumerate(outcomes) if isinstance(outcome, Exception)}
            assert failed == taken_by_the_dead and 0 < len(failed) <= 2
            for index in failed:
                error = outcomes[index]
                assert isinstance(error, RolloutError) and error.origin is Origin.SANDBOX
                assert "the host is gone" in error.message
            for index, outcome in enumerate(outcomes):
                assert index in failed or outcome["id"] == index
            assert_each_ran_once(hosts, 24)
            # The dead host's slot gets a new host, and the next batch uses it.
            await eventually(lambda: "local-3" in [handle.name for handle in pool.hosts])
            assert pool.ejected == {} and len(pool.hosts) == 3
            stats = pool.stats
            assert (stats.ejections, stats.replacements, stats.replacements_failed) == (1, 1, 0)
            assert stats.chunks_failed == {"sandbox": 1}  # the dead host's one chunk (of 2)
            assert stats.host_states() == {"healthy": 3, "lost": 1}
            assert stats.chunks_answered == 11 and stats.chunks_in_flight == 0
            results = await pool.run(examples(6, sleep_s=0.2))
            assert len({result["pid"] for result in results}) == 3
            assert killed not in {result["pid"] for result in results}
    (why,) = [r.trio_gym_fields["why"] for r in caplog.records if r.msg == "host_ejected"]
    assert why == "its process is gone"
    assert hosts.left_behind() == []


async def test_a_replacement_that_fails_to_start_loses_its_slot_not_the_pool(
    hosts: Hosts, tmp_path: Path
) -> None:
    marker = tmp_path / "fail-start"
    spec = hosts.spec("tests.user_runner:failing_start_once_marked")
    spec = HostSpec({**spec.environment, "TRIO_GYM_TEST_FAIL_START": str(marker)}, spec.serve_args)
    provider = LocalProvider()
    with trio.fail_after(HANG_GUARD_S):
        async with (
            provider.hosts(2, spec) as handles,
            HostPool(
                handles,
                SchedulerSettings(per_host_in_flight=1, probe_interval_s=0.1),
                client_settings=ClientSettings(chunk_size=2),
                launcher=provider,
            ) as pool,
        ):
            marker.touch()  # from now on no host of this image starts
            outcomes, killed = await run_and_signal_the_first_host(
                pool, hosts, examples(12, sleep_s=0.2), signal.SIGKILL
            )
            failed = {i for i, outcome in enumerate(outcomes) if isinstance(outcome, Exception)}
            assert failed == {run["id"] for run in hosts.runs() if run["pid"] == killed}
            assert_each_ran_once(hosts, 12)
            # Ejected first, then the replacement's failure is added once its start has failed.
            await eventually(lambda: "replacement failed" in "".join(pool.ejected.values()))
            ((name, why),) = pool.ejected.items()
            assert why.startswith("its process is gone; its replacement failed: host local-2")
            assert (pool.stats.replacements, pool.stats.replacements_failed) == (0, 1)
            assert pool.stats.host_states() == {"healthy": 1, "lost": 1}
            assert "this image no longer starts" in why
            # The pool carries on with the host it has left.
            assert len(await pool.run(examples(4, sleep_s=0))) == 4
    assert hosts.left_behind() == []


async def test_a_host_that_stalls_mid_batch_is_ejected_and_the_rest_carry_the_batch(
    hosts: Hosts,
) -> None:
    settings = SchedulerSettings(
        per_host_in_flight=1, max_host_failures=2, probe_timeout_s=0.5, probe_interval_s=0.1
    )
    with trio.fail_after(HANG_GUARD_S):
        async with (
            LocalProvider().hosts(3, hosts.spec()) as handles,
            HostPool(
                handles, settings, client_settings=ClientSettings(chunk_size=2, idle_timeout_s=1)
            ) as pool,
        ):
            outcomes, stalled = await run_and_signal_the_first_host(
                pool, hosts, examples(16, sleep_s=0.2), signal.SIGSTOP
            )
            failed = {i for i, outcome in enumerate(outcomes) if isinstance(outcome, Exception)}
            assert failed == {run["id"] for run in hosts.runs() if run["pid"] == stalled}
            assert all("no byte of the body arrived for 1 s" in str(outcomes[i]) for i in failed)
            assert_each_ran_once(hosts, 16)
            await eventually(lambda: pool.ejected)
            ((ejected, why),) = pool.ejected.items()
            assert "no answer to GET /health within 0.5 s" in why
            assert ejected not in [handle.name for handle in pool.hosts]
            # Left stopped: leaving the provider's block still ends it (SIGKILL after the grace).
    assert hosts.left_behind() == []


@asynccontextmanager
async def host_that_never_starts(hosts: Hosts, tmp_path: Path) -> AsyncIterator[HostHandle]:
    """A real host whose runner's import hangs: ``/health`` and every batch answer 503."""
    port_file = tmp_path / "stuck.port"
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_gym", "serve", "--port", "0", "--port-file", str(port_file)],
        env={
            **os.environ,
            "NMP_RUNNER": "tests.hanging_import_runner:factory",
            TOKEN_VARIABLE: hosts.token,
        },
        stderr=subprocess.DEVNULL,
    )
    try:
        while not port_file.exists():  # noqa: ASYNC110 (another process writes the file)
            await trio.sleep(0.01)
        yield HostHandle("stuck", f"http://127.0.0.1:{int(port_file.read_text())}")
    finally:
        process.kill()
        await process.wait()


async def test_a_host_answering_503_gets_nothing_run_and_is_ejected(
    hosts: Hosts, tmp_path: Path
) -> None:
    with trio.fail_after(HANG_GUARD_S):
        async with (
            host_that_never_starts(hosts, tmp_path) as stuck,
            LocalProvider().hosts(2, hosts.spec()) as handles,
            HostPool(
                [stuck, *handles],
                SchedulerSettings(per_host_in_flight=2, probe_interval_s=0.1),
                client_settings=ClientSettings(chunk_size=2),
            ) as pool,
        ):
            results = await pool.run(examples(20, sleep_s=0.05))
            assert [result["id"] for result in results] == list(range(20))
            assert_each_ran_once(hosts, 20)
            await eventually(lambda: pool.ejected)
            assert list(pool.ejected) == ["stuck"]
            # Its last failure names why: its probe's "503 starting" or a send's "503
            # not_ready ... starting", whichever came last (the two race).
            why = pool.ejected["stuck"]
            assert "503" in why and "starting" in why, why
    assert hosts.left_behind() == []


async def test_when_every_host_is_gone_the_queued_chunks_fail_naming_each_end(
    hosts: Hosts, tmp_path: Path
) -> None:
    with trio.fail_after(HANG_GUARD_S):
        async with (
            host_that_never_starts(hosts, tmp_path) as stuck,
            HostPool(
                [stuck],
                SchedulerSettings(max_host_failures=2, probe_interval_s=0.1),
                client_settings=ClientSettings(chunk_size=1),
            ) as pool,
        ):
            outcomes = await pool.outcomes(examples(3, sleep_s=0))
            # A batch after the last host went fails at once, saying the same.
            with pytest.raises(RolloutError, match="no host is left"):
                await pool.run(examples(1, sleep_s=0))
    assert all(isinstance(outcome, RolloutError) for outcome in outcomes)
    message = str(outcomes[1])
    assert re.search(r"chunk 2 was not run: no host is left \(stuck: \d failures in a row", message)
    assert (
        "its last send, to stuck: the host refused the request with HTTP 503 not_ready: the host "
        "is starting"
    ) in message
    assert hosts.runs() == []


@pytest.mark.parametrize(
    ("runner", "serve_args", "expected"),
    [
        (
            "tests.hanging_import_runner:factory",
            (),
            "was not ready within 3 s (last /health: HTTP 503 starting",
        ),
        (
            "tests.user_runner:failing_start",
            (),
            "failed to start: HTTP 503 failed at stage starting_runner: RuntimeError: "
            "the model endpoint refused every connection",
        ),
        (
            "tests.user_runner:recording",
            ("--port-file", "/nonexistent/port"),
            "exited with status 2 before it was ready; the end of its output:\n"
            "trio-gym serve: listening on port",
        ),
    ],
)
async def test_a_launch_whose_hosts_do_not_become_ready_fails_naming_why_and_leaves_nothing(
    hosts: Hosts, runner: str, serve_args: tuple[str, ...], expected: str
) -> None:
    spec = hosts.spec(runner, serve_args, ready_timeout_s=3.0)
    with trio.fail_after(HANG_GUARD_S), pytest.raises(LaunchFailed) as failed:
        async with LocalProvider().hosts(2, spec):
            raise AssertionError("the block ran although no host was ready")
    assert expected in str(failed.value)
    assert hosts.left_behind() == []


async def test_launched_hosts_hold_the_identity_their_handles_carry(hosts: Hosts) -> None:
    """Each host a provider launches answers only callers that carry its identity: its handle's
    probe finds it, another host's identity is refused."""
    provider = LocalProvider()
    with trio.fail_after(HANG_GUARD_S):
        async with provider.hosts(2, hosts.spec()) as (first, second):
            assert first.identity and second.identity and first.identity != second.identity
            assert (await probe(first, timeout_s=5)).status is HealthStatus.READY
            misdirected = HostHandle("misdirected", first.url, identity=second.identity)
            assert (await probe(misdirected, timeout_s=5)).status is HealthStatus.WRONG_HOST
            client = RolloutClient(first.url, identity=second.identity)
            with pytest.raises(RolloutError) as failure:
                await client.run(examples(1, sleep_s=0))
            assert failure.value.code == "wrong_host"
            assert second.identity not in repr(misdirected) + repr(second)  # never in logs
    assert hosts.runs() == []
    assert hosts.left_behind() == []
