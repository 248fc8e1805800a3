"""Records a trainer can train on, through the real host: every record finished by Gym's
finalizer (here a fake worker on memory streams: ``tests/fake_finalizer.py``), captures cleared
before each ``/run``, snapshots retired only once delivered, failures as failure records. Gym's
own finalizer against real Gym: ``tests/test_gym_real.py``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from tests.fake_finalizer import FakeWorkers, default_behaviour
from tests.fake_gym import FakeAgentServer, FakeHeadServer, agent_instance
from tests.helpers import read_reply, request_bytes, running_host, tcp_exchange
from trio_gym.config import ServeConfig
from trio_gym.host import Host, handle_connection
from trio_gym.runners import AgentSettings, AgentsRunner
from trio_gym.runners.gym import GymStartFailed
from trio_gym.trainer import ClientSettings, HostHandle, HostPool, RolloutClient

HANG_GUARD_S = 30
ROWS = [("Accept", "application/x-ndjson")]
CAPTURING = {"observability_enabled": True, "model_call_capture_dir": "/captures"}


def row(**fake: Any) -> dict[str, Any]:
    return {"agent_ref": {"name": "weather"}, "responses_create_params": {}, "_fake": fake}


class Rig:
    def __init__(self, host: Host, port: int, agent: FakeAgentServer, workers: FakeWorkers):
        self.host, self.port, self.agent, self.workers = host, port, agent, workers

    def ops(self, op: str) -> list[dict[str, Any]]:
        return self.workers.requests(op)


@asynccontextmanager
async def finalizing_host(behaviour: Any = default_behaviour, **config: Any) -> AsyncIterator[Rig]:
    """A host whose agents runner finalizes with fake workers, against a fake Gym deployment
    whose config switches capture on."""
    agent = FakeAgentServer("weather")
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.serve)
        head = FakeHeadServer({"weather": agent_instance(agent.port), **CAPTURING})
        head_port = await nursery.start(head.serve)
        workers = FakeWorkers(nursery, behaviour)
        settings = AgentSettings(agents={}, head_server=f"http://127.0.0.1:{head_port}")
        runner = AgentsRunner(settings, finalizer_worker=workers.start)
        async with trio.open_nursery() as services:  # as the host's services nursery runs it
            await services.start(runner.serve)
            async with running_host(runner=runner, **config) as (host, port):
                yield Rig(host, port, agent, workers)
            services.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


def lines_of(body: bytes) -> dict[Any, dict[str, Any]]:
    parsed = [json.loads(line) for line in body.split(b"\n") if line.strip()]
    return {line.get("index", "done"): line for line in parsed}


async def test_every_record_is_finished_after_its_captures_were_cleared_before_its_run() -> None:
    sent_before_prepare: dict[int, list[int]] = {}

    async def note_what_ran_before_each_prepare(worker: int, request: dict[str, Any]) -> Any:
        if request["op"] == "prepare":
            task = request["row"]["_ng_task_index"]
            sent_before_prepare[task] = [r["_ng_task_index"] for r in rig.agent.requests]
        return await default_behaviour(worker, request)

    async with finalizing_host(note_what_ran_before_each_prepare) as rig:
        batch = {"examples": [row(), row()], "row_offset": 10}
        with trio.fail_after(HANG_GUARD_S):
            reply = await tcp_exchange(rig.port, request_bytes(batch))
            await rig.workers.wait_until_retired(2)
    results = reply.json()["results"]
    assert [r["finished_by"] for r in results] == [1, 1]
    # Numbered from the request's row_offset, as Gym numbers rows by their place in the input.
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in results] == [(10, 0), (11, 0)]
    # Each row's captures were cleared before its /run reached Gym, not after.
    assert sorted(sent_before_prepare) == [10, 11]
    assert all(task not in before for task, before in sent_before_prepare.items())
    assert sorted(request["_ng_task_index"] for request in rig.agent.requests) == [10, 11]
    finished = rig.ops("finish")
    assert all(f["latency_ms"] is not None and f["latency_ms"] >= 0 for f in finished)
    assert all(f["record"]["agent_ref"] == {"name": "weather"} for f in finished)
    assert sorted(rig.workers.retired()) == ["10-0", "11-0"]  # both delivered


async def test_a_snapshot_is_retired_once_its_row_is_written_and_never_when_undelivered() -> None:
    async with finalizing_host() as rig:
        stream = await trio.open_tcp_stream("127.0.0.1", rig.port)
        batch = {"examples": [row(), row(hang=True)]}
        with trio.fail_after(HANG_GUARD_S):
            await stream.send_all(request_bytes(batch, headers=ROWS))
            await rig.workers.wait_until_retired(1)  # the quick row's line was written
            await stream.aclose()  # the caller leaves before the other's row
            await rig.agent.wait_for(lambda agent: agent.running == 0)
        # A document that is never delivered: its finished record keeps its snapshot.
        stream = await trio.open_tcp_stream("127.0.0.1", rig.port)
        undelivered = {"examples": [row(), row(hang=True)], "row_offset": 10}
        with trio.fail_after(HANG_GUARD_S):
            await stream.send_all(request_bytes(undelivered))
            await rig.workers.wait_for("finish", 2)  # the quick row of this batch is finished
            await stream.aclose()
            await rig.agent.wait_for(lambda agent: agent.running == 0)
    assert rig.workers.retired() == ["0-0"]  # only the row that reached its caller
    finished = [f["row"]["_ng_task_index"] for f in rig.ops("finish")]
    assert finished == [0, 10]  # a cancelled example is never finalized


async def test_a_row_whose_line_never_reaches_its_caller_keeps_its_snapshot(
    autojump_clock: trio.abc.Clock,
) -> None:
    agent = FakeAgentServer("weather")
    head = FakeHeadServer({"weather": agent_instance(1), **CAPTURING})
    async with trio.open_nursery() as nursery:

        async def open_stream(endpoint: Any) -> trio.abc.Stream:  # the head on 2, the agent on 1
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon((head if endpoint.port == 2 else agent).handle, server)
            return client

        workers = FakeWorkers(nursery)
        settings = AgentSettings(agents={}, head_server="http://head:2")
        runner = AgentsRunner(settings, opener=open_stream, finalizer_worker=workers.start)
        await nursery.start(runner.serve)
        host = Host(ServeConfig(port=0, send_timeout_s=30), runner=runner)
        # A caller that reads the head and nothing more: the row's line does not fit in what
        # the connection buffers.
        caller, served = trio.testing.lockstep_stream_pair()
        nursery.start_soon(partial(handle_connection, host, served, buffer_bytes=200))
        with trio.fail_after(600):
            await caller.send_all(request_bytes({"examples": [row(delay_s=1)]}, headers=ROWS))
            answer = b""
            while not answer.endswith(b"\r\n\r\n"):
                answer += await caller.receive_some(1)
            await workers.wait_for("finish", 1)
            await trio.sleep(60)  # past send_timeout_s: the host has given the caller up
        nursery.cancel_scope.cancel()
    assert host.services.stats.connections_open == 0  # given up, its batch abandoned
    assert workers.retired() == []  # its line never left: nothing retired


async def test_a_document_that_fails_as_a_whole_retires_none_of_its_finished_records() -> None:
    async with finalizing_host() as rig:
        batch = {"examples": [row(), row(status=500, delay_s=0.2)]}
        with trio.fail_after(HANG_GUARD_S):
            reply = await tcp_exchange(rig.port, request_bytes(batch))
    assert reply.json()["error"]["code"] == "internal"
    assert len(rig.ops("finish")) == 2  # the first was finished (and so was the failure)
    assert rig.workers.retired() == []  # never delivered: its results were not the answer


async def test_a_record_gyms_finalizer_cannot_finish_fails_its_row_naming_why() -> None:
    async def refuse_the_second(worker: int, request: dict[str, Any]) -> Any:
        if request["op"] == "finish" and request["row"]["_ng_task_index"] == 1:
            return {"ok": False, "error": "KeyError: 'ng_trajectory'"}
        return await default_behaviour(worker, request)

    async with finalizing_host(refuse_the_second) as rig:
        with trio.fail_after(HANG_GUARD_S):
            rows = await tcp_exchange(
                rig.port, request_bytes({"examples": [row(), row()]}, headers=ROWS)
            )
            document = await tcp_exchange(rig.port, request_bytes({"examples": [row(), row()]}))
    lines = lines_of(rows.body)
    assert lines[0]["result"]["finished_by"] == 1
    record = lines[1]["record"]
    assert record["_ng_failure_class"] == "runner_error"
    assert record["_ng_failure_type"] == "FinalizeFailed"
    assert "Gym's finalizer refused: KeyError: 'ng_trajectory'" in record["_ng_failure_message"]
    assert record["_ng_task_index"] == 1  # identity carried onto the failure record
    error = document.json()["error"]  # a document fails as a whole, as the upstream host's does
    assert error["code"] == "internal" and "FinalizeFailed" in error["message"]
    runner = rig.host.services.lifecycle.runner
    assert isinstance(runner, AgentsRunner)
    counts = runner.finalization  # what /metrics shows
    assert counts is not None and counts.calls["finish"] == 4 and counts.calls["prepare"] == 4
    assert dict(counts.failures) == {"finish": 2}  # the second row's, in each request


async def test_a_failed_run_keeps_its_failure_record_when_gym_cannot_finish_it() -> None:
    async def refuse_failures(worker: int, request: dict[str, Any]) -> Any:
        if request["op"] == "finish" and "_ng_failure_class" in request["record"]:
            return {"ok": False, "error": "KeyError: 'response'"}
        return await default_behaviour(worker, request)

    async with finalizing_host(refuse_failures) as rig:
        batch = {"examples": [row(status=500)], "failures": "records"}
        with trio.fail_after(HANG_GUARD_S):
            reply = await tcp_exchange(rig.port, request_bytes(batch))
    (record,) = reply.json()["results"]
    # Still the /run's own failure: its class, status and body, not the finalizer's refusal.
    assert record["_ng_failure_class"] == "agent_run_error"
    assert record["_ng_failure_http_status"] == 500 and "finished_by" not in record


async def test_failure_records_in_place_keep_every_other_result() -> None:
    async with finalizing_host() as rig:
        batch = {"examples": [row(), row(status=500), row()], "failures": "records"}
        with trio.fail_after(HANG_GUARD_S):
            reply = await tcp_exchange(rig.port, request_bytes(batch))
    first, failed, third = reply.json()["results"]
    assert first["finished_by"] == third["finished_by"] == 1
    assert failed["_ng_failure_class"] == "agent_run_error"
    assert failed["_ng_failure_http_status"] == 500 and failed["finished_by"] == 1  # by Gym too
    assert failed["_ng_task_index"] == 1 and failed["agent_ref"] == {"name": "weather"}
    assert rig.host.services.stats.examples_cancelled == 0  # its chunk-mates ran to the end


async def test_one_rollout_id_runs_once_at_a_time_while_its_captures_are_kept() -> None:
    async with finalizing_host() as rig:
        first = await trio.open_tcp_stream("127.0.0.1", rig.port)
        twin = {**row(hang=True), "_ng_task_index": 4, "_ng_rollout_index": 0}
        with trio.fail_after(HANG_GUARD_S):
            await first.send_all(request_bytes({"examples": [twin]}, headers=ROWS))
            await rig.agent.wait_for(lambda agent: agent.running == 1)
            second = await tcp_exchange(
                rig.port, request_bytes({"examples": [{**twin, "_fake": {}}]}, headers=ROWS)
            )
            next_try = {**twin, "_fake": {}, "_ng_attempt_index": 1}  # its own capture key
            third = await tcp_exchange(
                rig.port, request_bytes({"examples": [next_try]}, headers=ROWS)
            )
            await first.aclose()
    message = lines_of(second.body)[0]["error"]["message"]
    assert "rollout 4-0 is already running on this host" in message
    assert lines_of(third.body)[0]["result"]["finished_by"] == 1  # 4-0-a1 runs beside 4-0
    # The twin never reached Gym, nor cleared a capture: only the first and the next try did.
    assert [r.get("_ng_attempt_index") for r in rig.agent.requests] == [None, 1]
    assert len(rig.ops("prepare")) == 2


async def test_an_agents_host_that_cannot_finalize_says_so_once_and_in_its_health(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = FakeAgentServer("weather")
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.serve)
        head = FakeHeadServer({"weather": agent_instance(agent.port), **CAPTURING})
        head_port = await nursery.start(head.serve)
        config = ServeConfig(port=0, runner="agents", head_server=f"http://127.0.0.1:{head_port}")
        with caplog.at_level(logging.WARNING, logger="trio_gym"):
            async with running_host(config) as (host, port):
                with trio.fail_after(HANG_GUARD_S):
                    await host.lifecycle.settled.wait()
                    health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
                    reply = await tcp_exchange(port, request_bytes({"examples": [row()]}))
        nursery.cancel_scope.cancel()
    assert health.status == 200 and health.json()["status"] == "ready"
    detail = health.json()["detail"]
    assert "records are not finalized as Gym's collection finalizes them" in detail
    assert "observability_enabled" in detail and "--gym-python (NMP_GYM_PYTHON)" in detail
    warnings = [r for r in caplog.records if r.getMessage() == "records_not_finalized"]
    assert len(warnings) == 1
    assert reply.json()["results"][0]["reward"] == 0.5  # its rows still run


async def test_a_gym_runner_that_cannot_finalize_does_not_start() -> None:
    agent = FakeAgentServer("weather")
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.serve)
        head = FakeHeadServer({"weather": agent_instance(agent.port), **CAPTURING})
        head_port = await nursery.start(head.serve)
        workers = FakeWorkers(nursery)
        workers.refuse_start = PermissionError(13, "Permission denied")
        settings = AgentSettings(
            agents={}, head_server=f"http://127.0.0.1:{head_port}", finalize_required=True
        )
        runner = AgentsRunner(settings, finalizer_worker=workers.start)
        with pytest.raises(GymStartFailed, match=r"records are not finalized .*Permission denied"):
            await nursery.start(runner.serve)
        nursery.cancel_scope.cancel()


async def test_without_capture_in_gyms_config_nothing_is_finalized() -> None:
    agent = FakeAgentServer("weather")
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.serve)
        head = FakeHeadServer({"weather": agent_instance(agent.port)})
        head_port = await nursery.start(head.serve)
        workers = FakeWorkers(nursery)
        settings = AgentSettings(agents={}, head_server=f"http://127.0.0.1:{head_port}")
        runner = AgentsRunner(settings, finalizer_worker=workers.start)
        await nursery.start(runner.serve)
        async with running_host(runner=runner) as (host, port):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(request_bytes({"examples": [row()]}))
                reply = await read_reply(stream)
        nursery.cancel_scope.cancel()
    assert "finished_by" not in reply.json()["results"][0]
    assert workers.started == [] and runner.finalizer is None


async def test_chunks_of_one_input_are_numbered_by_their_place_in_it_on_every_host() -> None:
    async with finalizing_host() as rig:
        url = f"http://127.0.0.1:{rig.port}"
        settings = ClientSettings(chunk_size=2, failures="records")
        with trio.fail_after(HANG_GUARD_S):
            alone = await RolloutClient(url, settings).outcomes([row() for _ in range(5)])
            hosts = [HostHandle("a", url), HostHandle("b", url)]
            async with HostPool(hosts, client_settings=settings) as pool:
                pooled = await pool.outcomes([row() for _ in range(5)])
    for results in (alone, pooled):
        assert [r["_ng_task_index"] for r in results] == [0, 1, 2, 3, 4]
        assert all(result["finished_by"] == 1 for result in results)


async def test_with_the_control_plane_on_a_row_reaches_gym_with_the_rollout_id_it_is_known_by() -> (
    None
):
    async with finalizing_host(control_token="secret") as rig:
        with trio.fail_after(HANG_GUARD_S):
            reply = await tcp_exchange(rig.port, request_bytes({"examples": [row()]}))
    (result,) = reply.json()["results"]
    (prepared,) = rig.ops("prepare")
    (sent,) = rig.agent.requests
    # The host's episode and Gym's captures share one id: the one the result carries.
    assert prepared["row"]["_ng_rollout_id"] == sent["_ng_rollout_id"] == result["_ng_rollout_id"]
