"""The neighbour: another process on the same loopback as a host launched with an identity and
a control token. Without the identity (no header, an empty one) or with another one, it runs
nothing, cancels nothing and learns nothing but whether the host is ready, on every route and
method, even while the trainer runs a keyed batch whose key it holds; the trainer's own paths,
which present the identity, keep working against the same host. A real host process, a real
neighbour process (this module, run as ``python -m tests.test_neighbour``), the real clock."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

import trio

from tests.helpers import control_fields, raw_answer, request_bytes
from tests.processes import HANG_GUARD_S
from tests.recorded import Hosts, assert_each_ran_once, examples
from trio_gym.exposition import PREFIX
from trio_gym.fleet import LocalProvider
from trio_gym.host.lifecycle import STAGES
from trio_gym.http import BodyFailed, Endpoint, HttpLimits, NoResponse, exchange
from trio_gym.protocol.control import OPERATIONS, STATUS
from trio_gym.protocol.host_identity import HOST_IDENTITY_HEADER, identity_digest
from trio_gym.protocol.rollouts import (
    HEALTH_PATH,
    IDEMPOTENCY_KEY_HEADER,
    JSON_MEDIA,
    METRICS_PATH,
    NDJSON_MEDIA,
    RUN_PATH,
    new_idempotency_key,
)
from trio_gym.trainer import HostHandle, HostPool
from trio_gym.trainer.hosts import HealthStatus, probe
from trio_gym.trainer.scheduler import RemoteHost, SchedulerSettings

# Long enough that the neighbour (a Python process starting, then some fifty requests) is done
# while the trainer's keyed batch still runs; the test says so if it was not.
TRAINER_SLEEP_S: Final = 4.0
TRAINER_EXAMPLES: Final = 3
NEIGHBOUR_IDS: Final = 1000  # the neighbour's examples, were any to run, are recorded from here
REFUSAL_HEADERS: Final = {"content-type", "content-length", "connection"}

Ask = tuple[str, str, str, list[tuple[str, str]], bytes]


def neighbour_asks(key: str, token: str, directory: str) -> list[Ask]:
    """Every route and method the host knows (and some it does not), as the neighbour asks
    them: ``(name, method, target, headers, body)``; the control plane with the right token,
    the rollouts under the trainer's key."""
    bearer = [("Authorization", f"Bearer {token}"), ("Content-Type", JSON_MEDIA)]
    batch = json.dumps({"examples": [{"id": NEIGHBOUR_IDS + i, "sleep_s": 0} for i in range(2)]})
    asks: list[Ask] = [
        ("GET /health", "GET", HEALTH_PATH, [], b""),
        ("HEAD /health", "HEAD", HEALTH_PATH, [], b""),
        ("GET /metrics", "GET", METRICS_PATH, [], b""),
        *((f"OPTIONS {path}", "OPTIONS", path, [], b"") for path in (HEALTH_PATH, METRICS_PATH)),
        (f"OPTIONS {RUN_PATH}", "OPTIONS", RUN_PATH, [], b""),
        ("OPTIONS *", "OPTIONS", "*", [], b""),
        (f"GET {RUN_PATH}", "GET", RUN_PATH, [], b""),
        (f"PUT {RUN_PATH}", "PUT", RUN_PATH, [], batch.encode()),
        ("GET an unknown path", "GET", "/admin", [], b""),
        ("POST an unknown path", "POST", "/admin", [], b"{}"),
        (f"GET {STATUS.path}", "GET", STATUS.path, bearer, b""),
    ]
    for name, operation in OPERATIONS.items():
        if operation is STATUS:
            continue
        fields = control_fields(directory, lease_s=30.0)[name]
        deadline = time.time() + 60  # clock-ok: the control plane's deadlines are wall times
        body = {"checkpoint_id": "neighbour-1", "deadline": deadline, **fields}
        asks.append(
            (f"POST {operation.path}", "POST", operation.path, bearer, json.dumps(body).encode())
        )
    json_body = [("Content-Type", JSON_MEDIA)]
    asks += [
        (f"POST {RUN_PATH} unkeyed", "POST", RUN_PATH, json_body, batch.encode()),
        (
            f"POST {RUN_PATH} under a key of its own, as rows",
            "POST",
            RUN_PATH,
            [*json_body, (IDEMPOTENCY_KEY_HEADER, new_idempotency_key()), ("Accept", NDJSON_MEDIA)],
            batch.encode(),
        ),
        (
            f"POST {RUN_PATH} under the trainer's key",
            "POST",
            RUN_PATH,
            [*json_body, (IDEMPOTENCY_KEY_HEADER, key)],
            batch.encode(),
        ),
        (
            f"DELETE {RUN_PATH} under the trainer's key",
            "DELETE",
            RUN_PATH,
            [(IDEMPOTENCY_KEY_HEADER, key)],
            b"",
        ),
    ]
    return asks


def as_presented(variant: str) -> list[tuple[str, str]]:
    """The identity header the neighbour sends: none, an empty one, or one of its own."""
    if variant == "none":
        return []
    if variant == "empty":
        return [(HOST_IDENTITY_HEADER, "")]
    return [(HOST_IDENTITY_HEADER, secrets.token_hex(16))]


VARIANTS: Final = ("none", "empty", "wrong")


async def neighbour(url: str, key: str, token: str, directory: str) -> list[dict[str, Any]]:
    port = Endpoint.parse(url).port
    answers = []
    for variant in VARIANTS:
        for name, method, target, headers, body in neighbour_asks(key, token, directory):
            request = request_bytes(
                body, method=method, target=target, headers=[*headers, *as_presented(variant)]
            )
            got = await raw_answer(port, request, method)
            answer = {
                "status": got.status,
                "headers": got.headers,
                "body": got.body.decode(),
                "raw": got.raw.decode("latin-1"),
            }
            answers.append({"variant": variant, "ask": name, **answer})
    return answers


async def trainer_keyed_batch(handle: HostHandle, key: str, answered: dict[str, Any]) -> None:
    """The trainer's batch under ``key``, as its client sends one (the handle's headers); its
    answer, or how it failed, and when it ended."""
    body = json.dumps({"examples": examples(TRAINER_EXAMPLES, sleep_s=TRAINER_SLEEP_S)})
    try:
        response = await exchange(
            Endpoint.parse(handle.url),
            "POST",
            RUN_PATH,
            body.encode(),
            limits=HttpLimits(),
            max_response_bytes=1 << 20,
            idle_timeout_s=30,
            headers=[
                ("content-type", JSON_MEDIA),
                (IDEMPOTENCY_KEY_HEADER, key),
                *handle.request_headers(),
            ],
        )
    except (NoResponse, BodyFailed) as exc:
        answered["failed"] = str(exc)
    else:
        answered["status"] = response.status
        answered["document"] = json.loads(response.body)
    answered["ended_at"] = trio.current_time()


async def until_running(hosts: Hosts, count: int) -> None:
    while len(hosts.runs()) < count:  # noqa: ASYNC110 (the host process writes the record)
        await trio.sleep(0.02)


async def trio_gym_status(*args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "trio_gym", "status", *args, "--once", "--interval", "0.1"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


def assert_tells_only_whether_it_is_ready(
    answers: list[dict[str, Any]], handle: HostHandle, token: str
) -> None:
    """The neighbour heard, on /health without an identity, ready and nothing more; everywhere
    else the one fixed refusal; and never a secret, a digest, a stage or a metric."""
    assert {answer["variant"] for answer in answers} == set(VARIANTS)
    refusals: dict[int, set[str]] = {403: set(), 421: set()}
    for answer in answers:
        where = f"{answer['variant']} identity, {answer['ask']}: {answer}"
        stranger_health = answer["variant"] != "wrong" and answer["ask"] == "GET /health"
        if stranger_health:
            assert (answer["status"], json.loads(answer["body"])) == (200, {"status": "ready"})
            continue
        expected = 421 if answer["variant"] == "wrong" else 403
        assert answer["status"] == expected, where
        assert set(answer["headers"]) == REFUSAL_HEADERS, where  # no Allow, no Retry-After
        if answer["ask"].startswith("HEAD"):
            assert answer["body"] == "", where
            continue
        refusals[expected].add(answer["body"])
        for stage in STAGES:
            assert stage not in answer["body"], where
    assert len(refusals[403]) == 1 and len(refusals[421]) == 1  # one fixed answer each
    assert json.loads(refusals[403].pop())["error"]["code"] == "identity_required"
    assert json.loads(refusals[421].pop())["error"]["code"] == "wrong_host"
    secrets_of_the_host = (handle.identity, identity_digest(handle.identity), token, PREFIX)
    for answer in answers:
        for secret in secrets_of_the_host:
            assert secret not in answer["raw"], f"{answer['ask']} revealed {secret!r}"


async def test_a_neighbour_without_the_identity_runs_cancels_and_learns_nothing_but_ready(
    hosts: Hosts, tmp_path: Path
) -> None:
    """The neighbour presents no identity, an empty one and another one, on every route and
    method, the control plane with the right token, and DELETEs the trainer's batch by its key
    while it runs: every answer is the fixed refusal (or, on /health, ready), nothing ran,
    nothing was cancelled. Then the trainer's pool, probe, control client and ``trio-gym
    status --identity-file`` reach the same host, and ``trio-gym status`` without the file
    shows no metrics and says to give it."""
    token = secrets.token_urlsafe(24)
    key = new_idempotency_key()
    provider = LocalProvider()
    identity_file = tmp_path / "identity"
    with trio.fail_after(HANG_GUARD_S):
        async with provider.hosts(1, hosts.spec(control_token=token)) as (handle,):
            assert handle.identity and handle.control_token == token
            batch: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trainer_keyed_batch, handle, key, batch)
                await until_running(hosts, TRAINER_EXAMPLES)
                neighbour_run = await trio.run_process(
                    [
                        *(sys.executable, "-m", "tests.test_neighbour"),
                        *(handle.url, key, token, str(tmp_path / "checkpoint")),
                    ],
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
                neighbour_ended_at = trio.current_time()
            assert neighbour_run.returncode == 0, neighbour_run.stderr.decode()
            assert_tells_only_whether_it_is_ready(json.loads(neighbour_run.stdout), handle, token)
            # The trainer's batch, whose key the neighbour DELETEd, ran whole; nothing else ran.
            assert "failed" not in batch, batch
            assert batch["ended_at"] > neighbour_ended_at, "the neighbour outlasted the batch"
            assert batch["status"] == 200, batch
            assert [result["id"] for result in batch["document"]["results"]] == [0, 1, 2]
            assert_each_ran_once(hosts, TRAINER_EXAMPLES)
            assert "cancelled" not in hosts.record.read_text()

            # The trainer's own paths carry the identity, and the host serves them.
            more = [{"id": index, "sleep_s": 0} for index in range(3, 6)]
            async with HostPool([handle], SchedulerSettings(per_host_in_flight=1)) as pool:
                assert [result["id"] for result in await pool.run(more)] == [3, 4, 5]
            assert (await probe(handle, timeout_s=10)).status is HealthStatus.READY
            control = RemoteHost.launched(handle).control
            assert (await control.status(timeout_s=10)).phase == "idle"
            identity_file.write_text(handle.identity + "\n")
            holder = await trio_gym_status(handle.url, "--identity-file", str(identity_file))
            stranger = await trio_gym_status(handle.url)
    assert holder.returncode == 0, holder.stderr.decode()
    header, row = holder.stdout.decode().splitlines()
    assert row.split()[:4] == [handle.url, "ready", "ready", "0"]  # HOST HEALTH STAGE BATCHES
    assert stranger.returncode == 0, stranger.stderr.decode()
    header, row = stranger.stdout.decode().splitlines()
    assert row.split()[:2] == [handle.url, "ready"]
    assert "give --identity-file" in row
    assert row.split()[-5:] == ["-"] * 5  # BATCHES to FAILED: its metrics were not read
    assert_each_ran_once(hosts, 6)
    assert hosts.left_behind() == []


if __name__ == "__main__":
    url, key, token, directory = sys.argv[1:5]
    print(json.dumps(trio.run(neighbour, url, key, token, directory)))
