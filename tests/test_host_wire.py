"""Wire rules over real loopback sockets, on the real clock (TCP behaviour cannot be faked)."""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import struct
from typing import Any

import pytest
import trio
import trio.testing

from tests.helpers import (
    CountingRunner,
    Reply,
    ScriptedRunner,
    exchange,
    read_reply,
    request_bytes,
    running_host,
    tcp_exchange,
)
from tests.slow_to_stop_runner import SlowToStop
from trio_gym.config import ServeConfig
from trio_gym.http import HttpConnection, HttpLimits, SocketTransport, StreamTransport
from trio_gym.http.connection import PROBE_DELAY_S
from trio_gym.http.h11_build import h11
from trio_gym.logs import JsonLinesFormatter

HANG_GUARD_S = 30  # only a guard against a hang; no test asserts how long anything took


def error_code(reply: Any) -> str:
    return str(reply.json()["error"]["code"])


# --- framing ------------------------------------------------------------------------------


async def test_http_10_caller_gets_content_length_and_no_chunks() -> None:
    async with running_host(runner=CountingRunner(), heartbeat_interval_s=0.05) as (host, port):
        request = {"examples": [{"seed": 1, "meetings": 3, "think_s": 0.1}]}
        reply = await tcp_exchange(port, request_bytes(request, version="1.0"))
    assert reply.status == 200
    assert reply.framing == "content-length"
    assert "transfer-encoding" not in reply.headers
    assert int(reply.headers["content-length"]) == len(reply.body)
    assert reply.headers["connection"] == "close"
    assert not reply.body.startswith(b" ")  # no heartbeat leaked into a 1.0 body
    assert reply.json()["results"][0]["seed"] == 1


async def test_http_11_answer_is_chunked_with_heartbeats_then_the_document() -> None:
    async with running_host(runner=CountingRunner(), heartbeat_interval_s=0.05) as (host, port):
        request = {"examples": [{"seed": 2, "meetings": 3, "think_s": 0.1}]}
        reply = await tcp_exchange(port, request_bytes(request))
    assert reply.framing == "chunked" and reply.complete
    assert reply.heartbeat_times  # at least one heartbeat in 0.3 s at a 0.05 s interval
    assert reply.json()["results"][0]["seed"] == 2


@pytest.mark.parametrize("version", ["1.0", "1.1"])
async def test_empty_responses_carry_content_length_zero(version: str) -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        for target in ("/health", "/rollouts/run", "*"):
            request = request_bytes(method="OPTIONS", target=target, version=version)
            reply = await tcp_exchange(port, request, method=b"OPTIONS")
            assert reply.status == 200, target
            assert reply.headers.get("content-length") == "0", target
            assert "transfer-encoding" not in reply.headers
            assert "GET" in reply.headers["allow"] or "POST" in reply.headers["allow"]


async def test_every_response_says_connection_close_and_is_framed() -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        requests = [
            request_bytes(method="GET", target="/health"),
            request_bytes(method="GET", target="/nowhere"),
            request_bytes(b"[]"),
            request_bytes({"examples": []}),
            request_bytes({"examples": []}, version="1.0"),
        ]
        for request in requests:
            reply = await tcp_exchange(port, request)
            assert reply.headers["connection"] == "close"
            assert reply.framing in ("content-length", "chunked")
            assert reply.complete


# --- refusals -----------------------------------------------------------------------------


async def test_413_is_read_by_a_client_still_uploading_50_mb() -> None:
    async with running_host(runner=CountingRunner(), max_request_bytes=1024 * 1024) as (host, port):

        def upload() -> tuple[int, dict[str, Any], str | None]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_GUARD_S)
            try:
                conn.request("POST", "/rollouts/run", body=b"x" * (50 * 1024 * 1024))
                response = conn.getresponse()
                return (
                    response.status,
                    json.loads(response.read()),
                    response.getheader("connection"),
                )
            finally:
                conn.close()

        status, document, connection = await trio.to_thread.run_sync(upload)
    assert status == 413
    assert document["error"]["code"] == "payload_too_large"
    assert "52428800" in document["error"]["message"]
    assert connection == "close"


async def test_a_413_survives_a_body_that_starts_after_the_answer() -> None:
    """Refused before its body arrived, the caller's body then comes: a socket closed at once
    (nothing was unread at that moment) would answer it with a reset, and the reset destroys
    the 413 the caller has not read yet. The close waits for the caller's end instead."""
    async with running_host(runner=CountingRunner(), max_request_bytes=1024) as (host, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(
                b"POST /rollouts/run HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n"
            )
            await trio.sleep(0.3)  # the 413 is written meanwhile; nothing of the body is sent
            await stream.send_all(b"x" * 200_000)  # then a body the host will not read
            await trio.sleep(0.3)
            with trio.fail_after(HANG_GUARD_S):
                reply = await read_reply(stream)
    assert reply.status == 413 and error_code(reply) == "payload_too_large"


async def test_chunked_upload_over_the_limit_is_refused_as_it_arrives() -> None:
    async with running_host(runner=CountingRunner(), max_request_bytes=1000) as (host, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(
                b"POST /rollouts/run HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"400\r\n"
                + b"x" * 1024
                + b"\r\n"
            )
            reply = await read_reply(stream)  # the body never ends; the answer comes anyway
    assert reply.status == 413 and error_code(reply) == "payload_too_large"


async def test_expect_100_continue_over_the_limit_gets_413_without_the_body() -> None:
    async with running_host(runner=CountingRunner(), max_request_bytes=1000) as (host, port):
        head = (
            b"POST /rollouts/run HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(head)
            first = await stream.receive_some(100)
    assert first.startswith(b"HTTP/1.1 413 ")  # no 100 Continue invites a body it would refuse


async def test_expect_100_continue_within_the_limit_is_invited_and_answered() -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        body = b'{"examples": []}'
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(
                b"POST /rollouts/run HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
            )
            interim = await stream.receive_some(100)
            assert interim.startswith(b"HTTP/1.1 100 ")
            await stream.send_all(body)
            reply = await read_reply(stream)
    assert reply.status == 200 and reply.json()["results"] == []


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"GARBAGE\r\n\r\n", 400, "invalid_request"),
        (
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40) + b"\r\n\r\n",
            400,
            "invalid_request",
        ),
        (b"GET /health HTTP/2.0\r\nHost: t\r\n\r\n", 505, "http_version_not_supported"),
        (b"GET /health HTTP/1.1\r\n\r\n", 400, "invalid_request"),  # 1.1 without Host
        (
            b"POST /rollouts/run HTTP/1.1\r\nHost: t\r\nContent-Length: ten\r\n\r\n",
            400,
            "invalid_request",
        ),
        (
            b"POST /rollouts/run HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n",
            501,
            "not_implemented",
        ),
        (b"GET http://[::1/health HTTP/1.1\r\nHost: t\r\n\r\n", 400, "invalid_request"),
        (b"CONNECT example.com:443 HTTP/1.1\r\nHost: t\r\n\r\n", 400, "invalid_request"),
        (b"GET //[/health HTTP/1.1\r\nHost: t\r\n\r\n", 404, "not_found"),
        (b"GET * HTTP/1.1\r\nHost: t\r\n\r\n", 405, "method_not_allowed"),
        (
            b"POST /rollouts/run HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n10\r\n{"examples": []}\r\n0\r\n\r\n',
            400,
            "invalid_request",
        ),
        (request_bytes(b"[" * 100_000), 400, "invalid_request"),
    ],
    ids=[
        "garbage",
        "tls-hello",
        "http2",
        "no-host",
        "bad-length",
        "gzip-te",
        "bad-absolute-target",
        "authority-form",
        "odd-path",
        "get-star",
        "length-and-chunked",
        "deep-json",
    ],
)
async def test_bytes_that_are_not_our_http_are_refused_clearly(
    raw: bytes, status: int, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        reply = await tcp_exchange(port, raw)
        assert reply.status == status
        assert error_code(reply) == code
        assert reply.json()["error"]["message"]
        assert "connection_failed" not in caplog.text  # a refusal, not a crash in our code
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
        assert health.status == 200  # the server outlived it


async def test_oversized_head_gets_431() -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        raw = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
        reply = await tcp_exchange(port, raw)
    assert reply.status == 431 and error_code(reply) == "headers_too_large"


async def test_head_just_over_the_limit_in_one_read_gets_431() -> None:
    async with running_host(runner=CountingRunner(), max_head_bytes=2048) as (host, port):
        raw = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 2040 + b"\r\n\r\n"
        reply = await tcp_exchange(port, raw)
    assert reply.status == 431


async def test_silent_client_gets_408() -> None:
    async with running_host(runner=CountingRunner(), read_timeout_s=0.3) as (host, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            with trio.fail_after(HANG_GUARD_S):
                reply = await read_reply(stream)
    assert reply.status == 408 and error_code(reply) == "request_timeout"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"", "the body is empty"),
        (b"[1, 2]", "not list"),
        (b'{"examples": 3}', "examples"),
        (b'{"examples": [1]}', "examples.0"),
        (b'{"examples": [], "extra": 1}', "unknown key 'extra'"),
        (b'{"examples": [], "deadline_s": -1}', "deadline_s"),
        (b'{"examples": [], "deadline_s": NaN}', "NaN is not JSON"),
        (b'{"examples": [{"seed": "one"}]}', "examples[0]: seed"),
        (b'{"examples": [{"typo": 1}]}', "examples[0]: typo: unknown key"),
        (b"{}", "examples"),
    ],
)
async def test_malformed_batches_get_400_naming_the_problem(body: bytes, fragment: str) -> None:
    runner = CountingRunner()
    async with running_host(runner=runner) as (host, port):
        reply = await tcp_exchange(port, request_bytes(body))
    assert reply.status == 400 and error_code(reply) == "invalid_request"
    assert fragment in reply.json()["error"]["message"]
    assert not runner.started


@pytest.mark.parametrize(
    ("line", "named", "wrong"),
    [
        (b"trio-gym-host-identity: s3cr3t-identity\r", "trio-gym-host-identity", "a CR"),
        (b"Authorization: Bearer s3cr3t\x00token", "Authorization", "a NUL"),
        (b"Authorization: Bearer s3cr3t\rtoken", "Authorization", "a CR"),
        (b"X-Long: " + b"s3cr3t" * 2500 + b"\x00", "X-Long", "a NUL"),
        (b"Bearer s3cr3t-no-colon", "no ':'", ""),
    ],
    ids=["identity-cr", "token-nul", "token-inner-cr", "overlong", "no-colon"],
)
async def test_a_refused_header_line_is_named_never_quoted_in_the_answer_or_the_log(
    line: bytes, named: str, wrong: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by an adversarial run: the 400 (and its log line) quoted the whole header line,
    a secret included, and a 15,000-character line gave a 15,120-byte answer."""
    caplog.set_level(logging.INFO, logger="trio_gym")
    raw = b"GET /health HTTP/1.1\r\nHost: t\r\n" + line + b"\r\n\r\n"
    async with running_host(runner=CountingRunner(), host_identity="ours") as (host, port):
        reply = await tcp_exchange(port, raw)
    logged = "\n".join(JsonLinesFormatter().format(record) for record in caplog.records)
    assert reply.status in (400, 431) and len(reply.body) < 1024
    assert named in reply.json()["error"]["message"] and wrong in reply.json()["error"]["message"]
    assert "s3cr3t" not in reply.body.decode() and "s3cr3t" not in logged


async def test_a_refusal_echoes_a_bounded_escaped_piece_of_what_the_caller_sent() -> None:
    long_path = "/" + "p" * 10_000 + "%0d"
    async with running_host(runner=CountingRunner()) as (host, port):
        missing = await tcp_exchange(port, request_bytes(method="GET", target=long_path))
        method = await tcp_exchange(port, request_bytes(method="PATCH" * 100, target="/health"))
        many = await tcp_exchange(port, request_bytes({"examples": [1] * 100_000}))
    assert missing.status == 404 and len(missing.body) < 1024
    assert "10004 bytes" in missing.json()["error"]["message"]  # how long it was, not all of it
    assert method.status == 405 and len(method.body) < 1024
    assert many.status == 400 and len(many.body) < 4096
    assert "and 99990 more problem(s)" in many.json()["error"]["message"]


@pytest.mark.parametrize(
    "examples",
    [
        [{"seed": 1, "_ng_rollout_id": "r" * 2_000_000}] * 2,
        [{"seed": 1, "_ng_attempt_index": ["x" * 1_000_000]}],
    ],
    ids=["twin-rollout-ids", "attempt-not-an-integer"],
)
async def test_a_refused_example_is_named_with_a_bounded_piece_of_what_it_holds(
    examples: list[dict[str, Any]],
) -> None:
    """Found in review: two rows of one 2 MB rollout id were refused with a 2 MB answer."""
    runner = CountingRunner()
    async with running_host(runner=runner, control_token="t") as (host, port):
        reply = await tcp_exchange(port, request_bytes({"examples": examples}))
    assert reply.status == 400 and len(reply.body) < 4096 and "characters)" in reply.body.decode()
    assert not runner.started


async def test_unknown_path_404_and_wrong_method_405_with_allow() -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        missing = await tcp_exchange(port, request_bytes(method="GET", target="/rollouts"))
        wrong = await tcp_exchange(port, request_bytes(method="GET", target="/rollouts/run"))
        wrong_health = await tcp_exchange(port, request_bytes(b"{}", target="/health"))
        head = await tcp_exchange(
            port, request_bytes(method="HEAD", target="/health"), method=b"HEAD"
        )
    assert missing.status == 404 and error_code(missing) == "not_found"
    assert wrong.status == 405 and error_code(wrong) == "method_not_allowed"
    assert wrong.headers["allow"] == "POST, DELETE, OPTIONS"
    assert wrong_health.status == 405 and wrong_health.headers["allow"] == "GET, OPTIONS"
    assert head.status == 405 and head.body == b""  # HEAD: headers only, as a GET would have
    assert int(head.headers["content-length"]) > 0


async def raw_answer(port: int, request: bytes) -> bytes:
    """Everything the host writes back, until it closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        await stream.send_eof()
        received = b""
        with trio.fail_after(30):
            while data := await stream.receive_some(65536):
                received += data
    return received


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (b"HEAD /health HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: identity\r\n\r\n", 501),
        (b"HEAD /health HTTP/1.1\r\nHost: h\r\nbroken header\r\n\r\n", 400),
        (b"HEAD /health HTTP/1.1\r\nHost: h\r\nX: " + b"x" * 20000 + b"\r\n\r\n", 431),
        (b"HEAD /health HTTP/2.0\r\nHost: h\r\n\r\n", 505),
        (
            b"HEAD /health HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            400,
        ),
        (b"HEAD /nowhere HTTP/1.1\r\nHost: h\r\n\r\n", 404),
        (b"HEAD /rollouts/run HTTP/1.0\r\n\r\n", 405),
    ],
    ids=[
        "framing-501",
        "malformed-400",
        "too-large-431",
        "version-505",
        "smuggling-400",
        "404",
        "405",
    ],
)
async def test_no_answer_to_head_carries_a_body_whatever_refused_it(
    request_head: bytes, status: int
) -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        answer = await raw_answer(port, request_head)
    head, separator, body = answer.partition(b"\r\n\r\n")
    assert separator and head.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert body == b""  # RFC 9110 §9.3.2: a response to HEAD has no content
    assert b"\r\ncontent-length: " in head.lower()  # framed all the same


async def test_extra_connections_beyond_the_cap_get_503_host_busy() -> None:
    async with running_host(runner=CountingRunner(), max_connections=1) as (host, port):
        holder = await trio.open_tcp_stream("127.0.0.1", port)  # takes the only slot
        async with holder:
            while host.services.stats.connections_open < 1:  # noqa: ASYNC110 (the host has no such event)
                await trio.sleep(0.01)
            reply = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
            assert reply.status == 503 and error_code(reply) == "host_busy"
            assert reply.headers["retry-after"] == "1"
        while host.services.stats.connections_open:  # noqa: ASYNC110
            await trio.sleep(0.01)
        again = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
    assert again.status == 200


# --- readiness ----------------------------------------------------------------------------


async def test_health_and_post_while_the_runner_loads_then_ready(
    slow_runner_module: Any,
) -> None:
    config = ServeConfig(port=0, runner="tests.slow_runner:factory")
    async with running_host(config) as (host, port):
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
        post = await tcp_exchange(port, request_bytes({"examples": []}))
        slow_runner_module.release()
        with trio.fail_after(HANG_GUARD_S):
            await host.lifecycle.settled.wait()
        ready = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
    assert health.status == 503
    assert health.json() == {"status": "starting", "stage": "starting_runner"}
    assert post.status == 503 and error_code(post) == "not_ready"
    assert ready.status == 200 and ready.json() == {"status": "ready"}


async def test_a_failed_start_is_reported_on_health_and_post() -> None:
    config = ServeConfig(port=0, runner="tests.no_such_module:factory")
    async with running_host(config) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            await host.lifecycle.settled.wait()
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
        post = await tcp_exchange(port, request_bytes({"examples": []}))
    assert health.status == 503
    assert health.json()["status"] == "failed"
    assert health.json()["error"]["code"] == "bootstrap_failed"
    assert "no_such_module" in health.json()["error"]["message"]
    assert post.status == 503 and error_code(post) == "bootstrap_failed"


# --- batches ------------------------------------------------------------------------------


async def test_health_answers_while_a_batch_runs() -> None:
    runner = CountingRunner()
    async with running_host(runner=runner) as (host, port), trio.open_nursery() as nursery:
        request = {"examples": [{"seed": 0, "meetings": 3, "think_s": 0.3}]}
        nursery.start_soon(tcp_exchange, port, request_bytes(request))
        with trio.fail_after(HANG_GUARD_S):
            await runner.wait_for(lambda r: r.running == 1)
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
        assert health.status == 200
        assert runner.running == 1  # the batch was still running when health answered


async def test_concurrent_batches_interleave() -> None:
    runner = CountingRunner()
    async with running_host(runner=runner) as (host, port):
        replies: list[Any] = []

        async def one(seed: int) -> None:
            request = {
                "examples": [{"seed": seed + i, "meetings": 3, "think_s": 0.3} for i in range(3)]
            }
            replies.append(await tcp_exchange(port, request_bytes(request)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)
            nursery.start_soon(one, 100)
    assert runner.peak == 6  # both batches' examples were running at one moment
    assert sorted(r.json()["results"][0]["seed"] for r in replies) == [0, 100]


IDENTITY_EXAMPLES: list[dict[str, Any]] = [
    {"sleep_s": 0.3, "_ng_task_index": 0, "_ng_rollout_index": 5, "_sg_example_id": "a"},
    {"sleep_s": 0.0, "_ng_task_index": 1, "result": {"_ng_task_index": 99}},
    {"sleep_s": 0.1, "_ng_task_index": 2, "result": {"_ng_task_index": None, "x": 1}},
    {"sleep_s": 0.2, "_ng_task_index": 3, "result": [1, 2]},
    {"sleep_s": 0.0, "result": {"y": 2}, "_ng_rollout_index": None},
    {"_ng_rollout_index": 7, "result": {"_ng_rollout_index": 0, "_sg_example_id": ""}},
    {"_ng_rollout_id": "r-1", "_ng_attempt_index": 2, "result": {}},
]
IDENTITY_RESULTS: list[Any] = [
    {"index": 0, "_ng_task_index": 0, "_ng_rollout_index": 5, "_sg_example_id": "a"},
    {"_ng_task_index": 99},  # the runner's own value wins
    {"_ng_task_index": 2, "x": 1},  # null is filled in
    [1, 2],  # a non-object result is left alone
    {"y": 2},  # no example key invented
    {"_ng_rollout_index": 0, "_sg_example_id": ""},  # falsy values are values too
    {"_ng_rollout_id": "r-1", "_ng_attempt_index": 2},  # the row's own episode keys
]


async def test_results_come_back_in_input_order_with_identity_keys_and_none_invented() -> None:
    runner = CountingRunner(ScriptedRunner())
    async with running_host(runner=runner) as (host, port):
        reply = await tcp_exchange(port, request_bytes({"examples": IDENTITY_EXAMPLES}))
    assert [index for index, _ in runner.completed] != list(range(7))  # out of order
    assert reply.json()["results"] == IDENTITY_RESULTS  # as the upstream host answers
    document = reply.json()
    assert set(document) == {"results", "job_id", "environment_path", "work_path"}


async def test_with_the_control_plane_on_every_result_names_its_episode() -> None:
    runner = CountingRunner(ScriptedRunner())
    async with running_host(runner=runner, control_token="t") as (host, port):
        reply = await tcp_exchange(port, request_bytes({"examples": IDENTITY_EXAMPLES}))
    results = reply.json()["results"]
    episode_keys = ("_ng_rollout_id", "_ng_attempt_index")
    identities = [
        {key: r.pop(key) for key in episode_keys} if isinstance(r, dict) else None for r in results
    ]
    assert results[:6] == IDENTITY_RESULTS[:6]
    # The episode identity is always carried: given, derived from task and rollout, or assigned.
    assert identities[0] == {"_ng_rollout_id": "0-5", "_ng_attempt_index": 0}
    assert identities[3] is None
    assert identities[6] == {"_ng_rollout_id": "r-1", "_ng_attempt_index": 2}
    assigned = [identity["_ng_rollout_id"] for identity in identities[:6] if identity][1:]
    assert len(set(assigned)) == 4 and all(
        rid.endswith(f"-{i}") for rid, i in zip(assigned, (1, 2, 4, 5), strict=True)
    )


async def test_rows_of_one_identity_both_run_unless_the_control_plane_tracks_episodes() -> None:
    twins = [
        {"_ng_task_index": 4, "_ng_rollout_index": 0, "sleep_s": 0.2, "result": {"n": n}}
        for n in (1, 2)
    ]
    chunks: list[Any] = []

    async def one_chunk(port: int, twin: dict[str, Any]) -> None:
        chunks.append(await tcp_exchange(port, request_bytes({"examples": [twin]})))

    async with running_host(runner=CountingRunner(ScriptedRunner())) as (host, port):
        both = await tcp_exchange(port, request_bytes({"examples": twins}))
    apart = CountingRunner(ScriptedRunner())
    async with running_host(runner=apart) as (host, port), trio.open_nursery() as nursery:
        for twin in twins:  # two chunks of one identity at once
            nursery.start_soon(one_chunk, port, twin)
    async with running_host(runner=CountingRunner(ScriptedRunner()), control_token="t") as (
        host,
        port,
    ):
        refused = await tcp_exchange(port, request_bytes({"examples": twins}))
    assert [r["n"] for r in both.json()["results"]] == [1, 2]
    assert sorted(chunk.json()["results"][0]["n"] for chunk in chunks) == [1, 2]
    assert apart.peak == 2  # the two chunks, one example each, ran at once
    assert refused.status == 400
    message = refused.json()["error"]["message"]
    assert "examples[0] and examples[1] are one episode (4-0)" in message


async def test_a_runner_failure_is_internal_naming_the_example_with_a_bounded_traceback() -> None:
    examples = [{"sleep_s": 5}, {"sleep_s": 0.05, "raise": "boom " * 5000}, {"sleep_s": 5}]
    runner = CountingRunner(ScriptedRunner())
    async with running_host(runner=runner) as (host, port):
        reply = await tcp_exchange(port, request_bytes({"examples": examples}))
        reply10 = await tcp_exchange(port, request_bytes({"examples": examples}, version="1.0"))
    error = reply.json()["error"]
    assert reply.status == 200 and error["code"] == "internal"
    assert error["message"].startswith("example 1 failed: RuntimeError: boom")
    assert "Traceback" in error["message"] and "tests/helpers.py" in error["message"]
    assert len(error["message"]) < 11_000  # 2000 of the 25 kB exception text, 8000 of traceback
    assert sorted(index for index, _ in runner.cancelled) == [0, 0, 2, 2]  # siblings cancelled
    assert reply10.status == 500 and error_code(reply10) == "internal"


async def test_an_example_environment_fault_is_reported_as_internal() -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        request = {"examples": [{"seed": 1}, {"seed": 2, "fail_at_step": 1}]}
        reply = await tcp_exchange(port, request_bytes(request))
    message = reply.json()["error"]["message"]
    assert message.startswith("example 1 failed: EnvironmentFault: scripted environment fault")


async def test_a_result_that_is_not_json_is_internal_naming_the_example() -> None:
    class NotJson(ScriptedRunner):
        async def run_example(self, example: Any, context: Any) -> Any:
            return {"reward": float("nan")} if context.index == 1 else {}

    async with running_host(runner=NotJson()) as (host, port):
        reply = await tcp_exchange(port, request_bytes({"examples": [{}, {}]}))
    assert error_code(reply) == "internal"
    assert "example 1 is not JSON" in reply.json()["error"]["message"]


async def test_results_over_max_response_bytes_are_refused_with_advice() -> None:
    runner = ScriptedRunner()
    examples = [{"result": "x" * 400} for _ in range(10)]
    async with running_host(runner=runner, max_response_bytes=2000) as (host, port):
        chunked = await tcp_exchange(port, request_bytes({"examples": examples}))
        buffered = await tcp_exchange(port, request_bytes({"examples": examples}, version="1.0"))
    assert chunked.status == 200 and error_code(chunked) == "payload_too_large"
    assert "max_response_bytes" in chunked.json()["error"]["message"]
    assert buffered.status == 500 and error_code(buffered) == "payload_too_large"


async def test_http_10_deadline_is_504() -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        request = {"examples": [{"seed": 0, "think_s": 5}], "deadline_s": 0.2}
        reply = await tcp_exchange(port, request_bytes(request, version="1.0"))
    assert reply.status == 504 and error_code(reply) == "deadline_exceeded"


async def test_pipelined_bytes_after_the_request_are_ignored() -> None:
    async with running_host(runner=CountingRunner()) as (host, port):
        request = request_bytes({"examples": [{"seed": 3}]})
        reply = await tcp_exchange(port, request + request_bytes(method="GET", target="/health"))
    assert reply.status == 200 and reply.json()["results"][0]["seed"] == 3


# --- callers that leave -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_caller_that_leaves_mid_batch_cancels_every_example(how: str) -> None:
    """With heartbeats an hour apart, only the caller watcher can notice the departure."""
    runner = CountingRunner()
    async with running_host(runner=runner, heartbeat_interval_s=3600) as (host, port):
        sock = socket.create_connection(("127.0.0.1", port))
        request = {"examples": [{"seed": i, "meetings": 3, "think_s": 60} for i in range(4)]}
        sock.sendall(request_bytes(request))
        with trio.fail_after(HANG_GUARD_S):
            await runner.wait_for(lambda r: r.running == 4)
            if how == "reset":  # SO_LINGER 0: close sends RST, as a killed trainer's kernel does
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            await runner.wait_for(lambda r: len(r.cancelled) == 4)
    assert not runner.completed
    assert host.services.stats.examples_running == 0


async def test_a_half_closed_caller_over_tcp_gets_its_answer() -> None:
    runner = CountingRunner()
    async with running_host(runner=runner, heartbeat_interval_s=0.1) as (host, port):
        request = {"examples": [{"seed": i, "meetings": 3, "think_s": 0.3} for i in range(2)]}
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            reply = await exchange(stream, request_bytes(request), half_close=True)
    assert reply.complete and len(reply.json()["results"]) == 2
    assert not runner.cancelled


async def test_the_half_close_probe_waits_by_the_measured_round_trip() -> None:
    """An end-of-file is probed with two writes: a departed caller's kernel answers the first
    with a reset within a round trip, so the second waits twice the kernel's measured round
    trip and a millisecond — the 0.2 s bound only where the kernel does not say."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listeners[0]:
        port = listeners[0].socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listeners[0].accept()
    async with client, server:
        await client.send_all(b"ping")
        await server.receive_some(4)
        await server.send_all(b"pong")
        await client.receive_some(4)
        over_tcp = HttpConnection(SocketTransport(server.socket), h11.SERVER, HttpLimits())
        round_trip = over_tcp.round_trip_s()
        assert round_trip is not None and 0 < round_trip < PROBE_DELAY_S
        assert over_tcp.probe_delay_s() < PROBE_DELAY_S
    _, memory = trio.testing.memory_stream_pair()
    in_memory = HttpConnection(StreamTransport(memory, send_timeout_s=30), h11.SERVER, HttpLimits())
    assert in_memory.round_trip_s() is None
    assert in_memory.probe_delay_s() == PROBE_DELAY_S


async def test_garbage_storm_never_kills_the_server() -> None:
    rng = random.Random(7)
    statuses: list[int] = []

    async def garbage(data: bytes) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(data)
            await stream.send_eof()
            statuses.append((await read_reply(stream)).status)

    async with running_host(runner=CountingRunner()) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                for _ in range(200):
                    nursery.start_soon(garbage, rng.randbytes(rng.randrange(1, 3000)))
        health = await tcp_exchange(port, request_bytes(method="GET", target="/health"))
    assert health.status == 200
    assert len(statuses) == 200 and set(statuses) <= {400, 431, 501, 505}


async def test_a_result_nested_too_deeply_to_encode_fails_its_example_cleanly() -> None:
    class Deep(ScriptedRunner):
        async def run_example(self, example: Any, context: Any) -> Any:
            if context.index == 0:
                return {"ok": True}
            nested: list[Any] = []
            for _ in range(5000):
                nested = [nested]
            return {"deep": nested}

    async with running_host(runner=Deep()) as (host, port):
        document = await tcp_exchange(port, request_bytes({"examples": [{}, {}]}))
        rows = await tcp_exchange(
            port,
            request_bytes({"examples": [{}, {}]}, headers=[("Accept", "application/x-ndjson")]),
        )
    assert document.complete and "example 1 is not JSON" in document.json()["error"]["message"]
    lines = [json.loads(line) for line in rows.body.split(b"\n") if line.strip()]
    assert lines[-1] == {"done": True, "completed": 1, "failed": 1}


async def test_heartbeats_go_on_while_a_stopping_host_waits_for_a_batch() -> None:
    """The pacer outlives the connections: during the shutdown grace a batch still beats."""
    async with running_host(
        runner=SlowToStop(1.5), heartbeat_interval_s=0.1, shutdown_grace_s=30
    ) as (
        host,
        port,
    ):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream, trio.open_nursery() as nursery:
            replies: list[Reply] = []

            async def read() -> None:
                replies.append(await read_reply(stream))

            await stream.send_all(request_bytes({"examples": [{}]}))
            nursery.start_soon(read)
            await trio.sleep(0.5)
            stopping_at = trio.current_time()
            host.lifecycle.request_shutdown()
    (reply,) = replies
    beats = [at for at, data in reply.pieces if data == b" " and at > stopping_at + 0.05]
    assert reply.json()["error"]["code"] == "shutting_down"
    assert len(beats) >= 3  # about 14 in the 1.5 s; none at all when the pacer stopped first
