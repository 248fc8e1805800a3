"""A host's secrets — the identity it was launched with and its control token — and a caller's
header values never reach a log line, an answer or ``/metrics``: not whole, not in part (no
eight characters of them in a row). A host in-process (real TCP, the real clock) and one as a
real process (its output is the trainer's log, ``process_output`` events) are sent normal
runs and every route under header values broken every way a header breaks (a stray CR, a
NUL, an LF, 15,000 characters, a wrong identity or token, a prefix or suffix of the right
one); a refusal stays short and names the header it objects to. A client refuses to send
such a value, naming the header and not the value; ``trio-gym serve`` and ``trio-gym status``
refuse one at start, redacted."""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import pytest
import trio

from tests.helpers import (
    CountingRunner,
    ScriptedRunner,
    control_fields,
    raw_answer,
    request_bytes,
    running_host,
)
from tests.processes import HANG_GUARD_S
from tests.recorded import Hosts
from trio_gym.errors import REDACTED
from trio_gym.exposition import PREFIX
from trio_gym.fleet import LocalProvider
from trio_gym.host.lifecycle import Ready
from trio_gym.logs import LOGGER, JsonLinesFormatter
from trio_gym.protocol.control import OPERATIONS, PREPARE, RESUME, STATUS
from trio_gym.protocol.host_identity import HOST_IDENTITY_HEADER
from trio_gym.protocol.rollouts import (
    HEALTH_PATH,
    IDEMPOTENCY_KEY_HEADER,
    JSON_MEDIA,
    METRICS_PATH,
    NDJSON_MEDIA,
    RUN_PATH,
    new_idempotency_key,
)
from trio_gym.trainer import ClientSettings, HostHandle, RolloutClient
from trio_gym.trainer.host_client import HostClient
from trio_gym.trainer.hosts import probe
from trio_gym.trainer.scheduler import RemoteHost

# Letters no hex id, key or digest and no lowercase word is made of: eight of them in a row in
# a log line or an answer can only have come from the secret.
SECRET_LETTERS: Final = "GHJKLMNPQRSTUVWXYZ"
FRAGMENT: Final = 8
MAX_REFUSAL_BYTES: Final = 2048
OVERLONG: Final = 15_000
AUTHORIZATION: Final = "Authorization"
# Every POST operation's fields besides its id and deadline: a body the host would carry out
# but for its deadline, which had passed (the variants must never close admission).
FIELDS: Final = control_fields("/nonexistent/secrets", lease_s=5.0)


def secret_text() -> str:
    return "".join(secrets.choice(SECRET_LETTERS) for _ in range(32))


def fragments(*values: str) -> set[str]:
    """Every run of ``FRAGMENT`` characters of ``values`` (a longer run holds one of them)."""
    return {value[i : i + FRAGMENT] for value in values for i in range(len(value) - FRAGMENT + 1)}


def leaks(texts: Iterable[str], *values: str) -> list[tuple[str, str]]:
    """Each text holding a fragment of ``values``: the fragment and the text's start."""
    pieces = fragments(*values)
    return [(piece, text[:300]) for text in texts for piece in pieces if piece in text]


class LogLines(logging.Handler):
    """Every record of logger ``trio_gym`` as the line the host would write (its fields
    included: a record's message is only the event's name)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonLinesFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    handler = LogLines()
    level = LOGGER.level
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.DEBUG)
    try:
        yield handler.lines
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(level)


@attrs.frozen
class Variant:
    """The identity and ``Authorization`` lines a request carries (raw: CR, NUL and LF go out
    as they are), and the header a refusal must name (when the value's form is what is
    wrong)."""

    name: str
    identity: tuple[str, ...]
    authorization: tuple[str, ...]
    objects_to: str = ""


def near_misses(secret: str, other: str) -> list[tuple[str, str | None]]:
    """Values that are almost ``secret``, or another host's, each with how it differs."""
    return [
        (f"{OVERLONG} characters long", (secret * OVERLONG)[:OVERLONG]),
        ("of another host", other),
        ("without its last character", secret[:-1]),
        ("without its first character", secret[1:]),
        ("its first eight characters", secret[:FRAGMENT]),
        ("its last eight characters", secret[-FRAGMENT:]),
        ("with a character more at the end", secret + "G"),
    ]


def variants(identity: str, token: str) -> list[Variant]:
    bearer = f"Bearer {token}"
    other = secret_text()

    def of_identity(name: str, value: str | None, objects_to: str = "") -> Variant:
        presented = () if value is None else (value,)
        return Variant(f"identity {name}", presented, (bearer,), objects_to)

    def of_token(name: str, value: str | None, objects_to: str = "") -> Variant:
        presented = () if value is None else (f"Bearer {value}",)
        return Variant(f"token {name}", (identity,), presented, objects_to)

    broken = [
        ("ending in a CR", "{}\r", True),
        ("with a CR inside", "{:.12}\r{}", True),
        ("ending in a NUL", "{}\x00", True),
        ("followed by an injected header line", "{}\nx-injected: 1", False),
        ("cut by an LF", "{:.12}\n{}", False),
    ]
    made = [Variant("as its holder sends it", (identity,), (bearer,))]
    for describe, shape, named in broken:
        made.append(
            of_identity(
                describe,
                shape.format(identity, identity[12:]),
                HOST_IDENTITY_HEADER if named else "",
            )
        )
        made.append(
            of_token(describe, shape.format(token, token[12:]), AUTHORIZATION if named else "")
        )
    more = [("with a character more at the start", "G" + identity), ("empty", "")]
    for describe, value in [*near_misses(identity, other), *more, ("absent", None)]:
        made.append(of_identity(describe, value))
    for describe, value in [*near_misses(token, other), ("absent", None)]:
        made.append(of_token(describe, value))
    overlong = Variant(
        "identity and token, both overlong (a head over its limit)",
        ((identity * OVERLONG)[:OVERLONG],),
        ((f"Bearer {token}" * OVERLONG)[:OVERLONG],),
    )
    return [*made, overlong]


Route = tuple[str, str, list[tuple[str, str]], bytes]


def routes(example: Mapping[str, Any]) -> list[Route]:
    """Every route and method, as a request would be sent to it; the control plane's POSTs
    with deadlines that had passed, so that none is carried out."""
    run = json.dumps({"examples": [example]}).encode()
    as_json = [("Content-Type", JSON_MEDIA)]
    keyed = [*as_json, (IDEMPOTENCY_KEY_HEADER, new_idempotency_key()), ("Accept", NDJSON_MEDIA)]
    found: list[Route] = [
        ("GET", HEALTH_PATH, [], b""),
        ("GET", METRICS_PATH, [], b""),
        ("OPTIONS", RUN_PATH, [], b""),
        ("POST", RUN_PATH, as_json, run),
        ("POST", RUN_PATH, keyed, run),
        ("DELETE", RUN_PATH, keyed[1:2], b""),
        ("GET", STATUS.path, [], b""),
        ("GET", "/nowhere", [], b""),
    ]
    for name, operation in OPERATIONS.items():
        if operation is not STATUS:
            body = {"checkpoint_id": "secrets-1", "deadline": 1.0, **FIELDS[name]}
            found.append(("POST", operation.path, as_json, json.dumps(body).encode()))
    return found


@attrs.frozen
class Answer:
    variant: Variant
    method: str
    target: str
    raw: bytes
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.raw.decode("latin-1")


def holder_headers(identity: str, token: str) -> list[tuple[str, str]]:
    return [(HOST_IDENTITY_HEADER, identity), (AUTHORIZATION, f"Bearer {token}")]


async def exercise(
    port: int, identity: str, token: str, example: Callable[[int], Mapping[str, Any]]
) -> list[Answer]:
    """Normal runs and a checkpoint as the holder, then every route under every variant, then
    ``/metrics``; every answer."""
    answers = []
    count = iter(range(10_000))
    holder = holder_headers(identity, token)

    async def send(
        variant: Variant, method: str, target: str, headers: list[Any], body: bytes
    ) -> None:
        request = request_bytes(body, method=method, target=target, headers=headers)
        got = await raw_answer(port, request, method)
        raw, status, content = got.raw, got.status, got.body
        answers.append(Answer(variant, method, target, raw, status, content))

    normal = Variant("as its holder sends it, a checkpoint", (identity,), (f"Bearer {token}",))
    for operation in (PREPARE, RESUME):
        call = {"checkpoint_id": "secrets-0", "deadline": time.time() + 60}  # clock-ok: wall
        body = json.dumps({**call, **FIELDS[operation.name]}).encode()
        await send(normal, "POST", operation.path, [*holder, ("Content-Type", JSON_MEDIA)], body)
    for variant in variants(identity, token):
        lines = [
            *((HOST_IDENTITY_HEADER, value) for value in variant.identity),
            *((AUTHORIZATION, value) for value in variant.authorization),
        ]
        for method, target, headers, body in routes(example(next(count))):
            await send(variant, method, target, [*headers, *lines], body)
    await send(normal, "GET", METRICS_PATH, holder, b"")
    return answers


def assert_nothing_leaked(answers: list[Answer], lines: list[str], *values: str) -> None:
    """No answer, log line or scrape holds a piece of ``values``; the host was exercised
    (runs answered, a checkpoint taken, refusals logged); every refusal is short and names
    what it objects to."""
    assert leaks((answer.text for answer in answers), *values) == []
    assert leaks(lines, *values) == []
    runs = [a for a in answers if a.variant.name == "as its holder sends it" and a.method == "POST"]
    assert [a.status for a in runs if a.target == RUN_PATH] == [200, 200]
    assert all(a.status == 200 for a in answers if a.variant.name.endswith("a checkpoint"))
    assert PREFIX in answers[-1].body.decode()  # the scrape, at the end
    assert any("refused" in line for line in lines)
    for answer in answers:
        where = f"{answer.variant.name}, {answer.method} {answer.target}: {answer.body[:300]!r}"
        if answer.status >= 400:
            assert len(answer.body) < MAX_REFUSAL_BYTES, where
        named = answer.variant.objects_to
        if named:
            assert answer.status == 400, where
            assert named.lower() in answer.body.decode().lower(), where
        elif answer.status == 401:
            assert AUTHORIZATION in answer.body.decode(), where
        elif answer.status == 403:
            assert HOST_IDENTITY_HEADER in answer.body.decode(), where
        elif answer.status == 421:
            assert "identity" in answer.body.decode(), where  # it does not name the header


async def test_an_in_process_host_never_answers_or_logs_a_piece_of_its_identity_or_token(
    log_lines: list[str],
) -> None:
    identity, token = secret_text(), secret_text()
    with trio.fail_after(HANG_GUARD_S):
        async with running_host(
            runner=ScriptedRunner(), host_identity=identity, control_token=token
        ) as (host, port):
            await host.lifecycle.wait_for_phase(lambda phase: isinstance(phase, Ready))
            answers = await exercise(port, identity, token, lambda n: {"result": {"n": n}})
    assert_nothing_leaked(answers, log_lines, identity, token)


async def test_a_host_process_never_answers_or_prints_a_piece_of_its_identity_or_token(
    hosts: Hosts, log_lines: list[str]
) -> None:
    """Its identity is the provider's (hex: a chance eight-digit match with a key or an id in
    the log is about one in ten thousand runs); its output is read whole once it stopped."""
    token = secret_text()
    provider = LocalProvider()
    with trio.fail_after(HANG_GUARD_S):
        async with provider.hosts(1, hosts.spec(control_token=token)) as (handle,):
            identity = handle.identity
            port = int(handle.url.rsplit(":", 1)[1])
            answers = await exercise(port, identity, token, lambda n: {"id": n, "sleep_s": 0})
    printed = [line for line in log_lines if "process_output" in line]
    assert any("refused" in line for line in printed)  # the host's own lines were read
    assert_nothing_leaked(answers, log_lines, identity, token)
    assert hosts.left_behind() == []


async def test_a_client_refuses_a_header_value_that_cannot_travel_naming_the_header_not_the_value(
    log_lines: list[str],
) -> None:
    """An identity, a platform's header or a control token ending in a CR (a file with
    Windows line endings): every client raises ``ValueError`` naming the header, with no
    piece of the value in it, its cause, or the log; the host runs nothing."""
    identity, token, platform_key = secret_text(), secret_text(), secret_text()
    runner = CountingRunner(ScriptedRunner())
    batch = [{"result": 1}]
    platform = [("x-platform-key", platform_key + "\r")]
    with trio.fail_after(HANG_GUARD_S):
        async with running_host(runner=runner, host_identity=identity, control_token=token) as (
            host,
            port,
        ):
            url = f"http://127.0.0.1:{port}"
            await host.lifecycle.wait_for_phase(lambda phase: isinstance(phase, Ready))
            once = ClientSettings(max_attempts=1)
            calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
                (
                    HOST_IDENTITY_HEADER,
                    lambda: RolloutClient(url, once, identity=identity + "\r").run(batch),
                ),
                (
                    HOST_IDENTITY_HEADER,
                    lambda: HostClient(url, identity=identity + "\r").post(batch),
                ),
                (
                    HOST_IDENTITY_HEADER,
                    lambda: probe(HostHandle("h", url, identity=identity + "\r"), timeout_s=10),
                ),
                (
                    "x-platform-key",
                    lambda: RolloutClient(url, once, headers=platform, identity=identity).run(
                        batch
                    ),
                ),
                (
                    "x-platform-key",
                    lambda: HostClient(url, headers=platform, identity=identity).post(batch),
                ),
                (
                    "authorization",
                    lambda: RemoteHost.launched(
                        HostHandle("h", url, control_token=token + "\r", identity=identity)
                    ).control.status(timeout_s=10),
                ),
            ]
            for header, call in calls:
                with pytest.raises(ValueError, match=header) as raised:
                    await call()
                told = "".join(traceback.format_exception(raised.value))
                assert leaks([told, repr(raised.value)], identity, token, platform_key) == []
    assert runner.started == []
    assert leaks(log_lines, identity, token, platform_key) == []


@pytest.mark.parametrize("variable", ["NMP_HOST_IDENTITY", "NMP_CONTROL_TOKEN"])
async def test_serve_refuses_a_secret_ending_in_a_cr_at_start_and_shows_it_redacted(
    variable: str,
) -> None:
    value = secret_text()
    with trio.fail_after(20):
        done = await trio.run_process(
            [sys.executable, "-m", "trio_gym", "serve", "--port", "0"],
            env={**os.environ, variable: value + "\r"},
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    said = (done.stdout + done.stderr).decode()
    assert done.returncode != 0, said
    assert f"{variable}={REDACTED}" in said
    assert leaks([said], value) == []


async def test_status_refuses_an_identity_file_that_cannot_travel_without_showing_it(
    tmp_path: Path,
) -> None:
    identity = secret_text()
    broken = tmp_path / "identity"
    broken.write_text(f"{identity[:12]}\r{identity[12:]}\n")
    with trio.fail_after(30):
        done: subprocess.CompletedProcess[bytes] = await trio.run_process(
            [
                *(sys.executable, "-m", "trio_gym", "status", "http://127.0.0.1:9"),
                *("--identity-file", str(broken), "--once"),
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    said = (done.stdout + done.stderr).decode()
    assert done.returncode == 2, said
    assert str(broken) in said and "not shown" in said
    assert leaks([said], identity) == []
