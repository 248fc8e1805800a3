"""Gym's finalizer as the host owns it (``trio_gym/runners/finalize.py``): every call bounded, a
worker that dies or hangs replaced, a refusal named — over fake workers on memory streams, on a
virtual clock. (Against real Gym: ``tests/test_gym_real.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tests.fake_finalizer import Die, FakeWorkers, default_behaviour
from trio_gym.runners.finalize import (
    FinalizationUnavailable,
    FinalizeFailed,
    RecordFinalizer,
    Retirement,
    capture_switches,
    stop_worker,
)

ROW = {"_ng_task_index": 0, "_ng_rollout_index": 0}
RECORD = {"reward": 1.0, **ROW}


def finalizer(workers: FakeWorkers, **settings: Any) -> RecordFinalizer:
    settings.setdefault("call_timeout_s", 60.0)
    settings.setdefault("max_line_bytes", 1024 * 1024)
    return RecordFinalizer({"observability_enabled": True}, workers.start, **settings)


async def test_a_record_is_finished_by_the_worker_and_its_snapshot_retired_by_its_identity(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as processes:
        workers = FakeWorkers(processes)
        records = finalizer(workers)
        async with trio.open_nursery() as nursery:
            await nursery.start(records.run)
            finished = await records.finish(ROW, RECORD, 12.5)
            records.retire(finished.retirement or Retirement("", "", 0))  # never waited for
            await workers.wait_until_retired(1)
            nursery.cancel_scope.cancel()  # the host stopping
    assert finished.record == {**RECORD, "finished_by": 1}
    assert finished.retirement == Retirement("0-0", "s1", 1)
    (worker,) = workers.started
    configure, finish, retire = worker.requests
    assert configure["op"] == "configure" and configure["config"] == {"observability_enabled": True}
    assert (finish["op"], finish["row"], finish["latency_ms"]) == ("finish", ROW, 12.5)
    assert retire["retire"] == [{"rollout_id": "0-0", "snapshot_id": "s1", "version": 1}]
    assert records.finalizes == ["model_call_capture"]
    # Stopped with its owner: its standard input closed, and it exited by itself.
    assert worker.stdin_closed and worker.returncode == 0


async def test_a_worker_that_does_not_answer_in_time_fails_the_call_and_is_replaced(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def hang_the_first_finish(worker: int, request: dict[str, Any]) -> Any:
        if request["op"] == "finish" and worker == 1:
            await trio.sleep_forever()
        return await default_behaviour(worker, request)

    async with trio.open_nursery() as nursery:
        workers = FakeWorkers(nursery, hang_the_first_finish)
        records = finalizer(workers, call_timeout_s=30.0)
        await nursery.start(records.run)
        started = trio.current_time()
        with (
            trio.fail_after(300),  # a call left unbounded fails here, rather than never
            pytest.raises(FinalizeFailed, match=r"answered nothing for 30 s") as failed,
        ):
            await records.finish(ROW, RECORD, None)
        waited = trio.current_time() - started
        again = await records.finish(ROW, RECORD, None)
        nursery.cancel_scope.cancel()
    assert waited == pytest.approx(30.0)
    assert "NMP_GYM_FINALIZE_TIMEOUT_S" in str(failed.value)
    assert workers.started[0].returncode == -9  # killed, not left to hang
    assert again.record["finished_by"] == 2


async def test_a_worker_that_dies_fails_exactly_its_calls_in_flight_naming_its_end(
    autojump_clock: trio.abc.Clock,
) -> None:
    arrived = trio.Event()
    in_flight: list[int] = []

    async def die_with_two_finishes_in_flight(worker: int, request: dict[str, Any]) -> Any:
        if request["op"] == "finish" and worker == 1:
            in_flight.append(request["id"])
            if len(in_flight) == 2:
                arrived.set()
                raise Die(1, "Traceback: MemoryError")
            await trio.sleep_forever()
        return await default_behaviour(worker, request)

    failures: list[str] = []
    failed_at: list[float] = []

    async def finish_expecting_failure() -> None:
        try:
            await records.finish(ROW, RECORD, None)
        except FinalizeFailed as exc:
            failures.append(str(exc))
            failed_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        workers = FakeWorkers(nursery, die_with_two_finishes_in_flight)
        records = finalizer(workers)
        await nursery.start(records.run)
        with trio.fail_after(300):  # a call a dead worker never fails fails here, not never
            async with trio.open_nursery() as calls:
                calls.start_soon(finish_expecting_failure)
                calls.start_soon(finish_expecting_failure)
        later = await records.finish(ROW, RECORD, None)
        nursery.cancel_scope.cancel()
    assert arrived.is_set() and len(failures) == 2
    assert failed_at == [0.0, 0.0]  # at its death, not at their bound
    for failure in failures:
        assert "Gym's finalizer exited with status 1" in failure
        assert "Traceback: MemoryError" in failure  # the end of its output names the cause
    assert later.record["finished_by"] == 2  # started again; the next record is finished


async def test_a_refusal_fails_that_call_naming_it_and_the_worker_goes_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def refuse_finish(worker: int, request: dict[str, Any]) -> Any:
        if request["op"] == "finish" and request["record"].get("bad"):
            return {"ok": False, "error": "KeyError: 'response'"}
        return await default_behaviour(worker, request)

    async with trio.open_nursery() as nursery:
        workers = FakeWorkers(nursery, refuse_finish)
        records = finalizer(workers)
        await nursery.start(records.run)
        with pytest.raises(FinalizeFailed, match=r"Gym's finalizer refused: KeyError: 'response'"):
            await records.finish(ROW, {**RECORD, "bad": True}, None)
        fine = await records.finish(ROW, RECORD, None)
        nursery.cancel_scope.cancel()
    assert fine.record["finished_by"] == 1 and len(workers.started) == 1


async def test_stray_lines_on_the_answer_channel_are_logged_and_skipped(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    async def stray_first(worker: int, request: dict[str, Any]) -> Any:
        if request["op"] == "finish":
            for line in (b"Loading nemo_gym...\n", b'{"id": [1]}\n', b"[2]\n", b'{"id": 999}\n'):
                await workers.started[0].say(line)
        return await default_behaviour(worker, request)

    async with trio.open_nursery() as nursery:
        workers = FakeWorkers(nursery, stray_first)
        records = finalizer(workers)
        await nursery.start(records.run)
        finished = await records.finish(ROW, RECORD, None)
        nursery.cancel_scope.cancel()
    assert finished.record["finished_by"] == 1 and len(workers.started) == 1
    strays = [r for r in caplog.records if r.getMessage() == "finalizer_stray_line"]
    assert len(strays) == 3  # an answer for a call that is gone (cancelled) is no stray


async def test_a_record_that_is_not_json_is_refused_before_it_is_sent(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        workers = FakeWorkers(nursery)
        records = finalizer(workers)
        await nursery.start(records.run)
        with pytest.raises(FinalizeFailed, match="cannot be handed to Gym's finalizer"):
            await records.finish(ROW, {"reward": float("nan")}, None)
        nursery.cancel_scope.cancel()
    assert [request["op"] for request in workers.started[0].requests] == ["configure"]


@pytest.mark.parametrize(
    ("behaviour", "expected"),
    [
        ("refuses", r"^the model-call capture folder /nowhere named by Gym's config is not a"),
        ("hangs", r"not ready within 180 s"),
        ("exits", r"exited with status 3; the end of its output:\nImportError: nemo_gym"),
        ("cannot start", r"cannot start Gym's finalizer: .*No such file"),
    ],
)
async def test_a_first_worker_that_cannot_be_configured_makes_finalization_unavailable(
    autojump_clock: trio.abc.Clock, behaviour: str, expected: str
) -> None:
    async def configure(worker: int, request: dict[str, Any]) -> Any:
        if behaviour == "refuses":
            folder = "the model-call capture folder /nowhere named by Gym's config is not a folder"
            return {"ok": False, "error": folder}
        if behaviour == "exits":
            raise Die(3, "ImportError: nemo_gym")
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        workers = FakeWorkers(nursery, configure)
        if behaviour == "cannot start":
            workers.refuse_start = FileNotFoundError(2, "No such file or directory")
        with pytest.raises(FinalizationUnavailable, match=expected):
            await nursery.start(finalizer(workers).run)
    assert all(worker.returncode is not None for worker in workers.started)  # none left running


async def test_a_call_while_no_worker_runs_waits_for_the_next_within_its_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def first_dies_then_the_others_fail_to_start(worker: int, request: dict[str, Any]) -> Any:
        if worker == 1 and request["op"] == "finish":
            raise Die(9)
        if worker > 1:
            raise Die(1, "ModuleNotFoundError: No module named 'omegaconf'")
        return await default_behaviour(worker, request)

    async with trio.open_nursery() as nursery:
        workers = FakeWorkers(nursery, first_dies_then_the_others_fail_to_start)
        records = finalizer(workers, call_timeout_s=40.0)
        await nursery.start(records.run)
        with pytest.raises(FinalizeFailed, match="exited with status 9"):
            await records.finish(ROW, RECORD, None)
        started = trio.current_time()
        with pytest.raises(FinalizeFailed) as waited:
            await records.finish(ROW, RECORD, None)
        elapsed = trio.current_time() - started
        nursery.cancel_scope.cancel()
    assert elapsed == pytest.approx(40.0)
    message = str(waited.value)
    assert "no Gym finalizer was running within 40 s" in message
    assert "could not be started again" in message and "No module named 'omegaconf'" in message
    # Tried again and again meanwhile, each pause longer, none longer than the cap.
    assert 4 <= len(workers.started) <= 15


async def test_a_long_queue_behind_a_working_finalizer_is_no_failure(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def twenty_seconds_each(worker: int, request: dict[str, Any]) -> Any:
        if request["op"] == "finish":
            await trio.sleep(20)
        return await default_behaviour(worker, request)

    finished: list[float] = []

    async def finish_one() -> None:
        await records.finish(ROW, RECORD, None)
        finished.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        workers = FakeWorkers(nursery, twenty_seconds_each, serial=True)
        records = finalizer(workers, call_timeout_s=30.0)
        await nursery.start(records.run)
        async with trio.open_nursery() as calls:
            for _ in range(10):
                calls.start_soon(finish_one)
        nursery.cancel_scope.cancel()
    # Answered one every 20 s: the last waited 200 s, past the bound, and none failed.
    assert finished == [20.0 * n for n in range(1, 11)]
    assert len(workers.started) == 1


async def test_a_caller_cancelled_while_its_request_is_written_cuts_no_line(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        workers = FakeWorkers(nursery, serial=True, full_pipe=True)  # writes wait
        records = finalizer(workers)
        await nursery.start(records.run)
        (worker,) = workers.started
        worker.reading = trio.Event()  # after its next request, the worker reads nothing more
        await records.prepare(ROW)
        with trio.move_on_after(1):
            await records.finish(ROW, {**RECORD, "response": "x" * 1000}, None)  # cut mid-write
        worker.reading.set()
        after = await records.finish(ROW, RECORD, None)
        nursery.cancel_scope.cancel()
    assert after.record["finished_by"] == 1  # the lines around it came whole: nothing failed
    assert [r["op"] for r in worker.requests] == ["configure", "prepare", "finish", "finish"]


async def test_a_worker_that_will_not_die_is_left_after_a_bounded_wait(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    async with trio.open_nursery() as processes:
        workers = FakeWorkers(processes)
        stubborn = await workers.start()
        stubborn.stubborn = True  # heeds neither end-of-file nor SIGKILL
        started = trio.current_time()
        with trio.fail_after(60):  # (the finalizer runs it shielded: unbounded, it never ends)
            await stop_worker(stubborn)
        waited = trio.current_time() - started
        processes.cancel_scope.cancel()
    assert waited == pytest.approx(10.0)  # its end-of-file grace, then the wait after SIGKILL
    assert any(r.getMessage() == "finalizer_unkillable" for r in caplog.records)
    assert stubborn.stdin_closed  # it was asked to go first


def test_finalization_follows_gyms_own_switches() -> None:
    assert capture_switches({}) == []
    assert capture_switches({"observability_enabled": False, "token_id_capture": {}}) == []
    assert capture_switches({"observability_enabled": True}) == ["observability_enabled"]
    assert capture_switches({"token_id_capture": {"enabled": True, "dir": "/t"}}) == [
        "token_id_capture.enabled"
    ]
