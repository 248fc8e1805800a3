"""The adversarial picture, re-run with the suite: a host launched with an identity and a control
token, on a real loopback port and the real clock, against what a hostile or broken network can
send it — a hundred thousand mutated, garbage and flooding requests, framing and smuggling
tricks, scrape storms, failure classes without end, abandoned keyed batches by the thousand,
and probes of its identity, its token and its keys.

Every request travels on a fresh TCP connection and its answer is read until the host closes,
each bounded by a ``trio.fail_after`` guard; no test asserts how long anything took. Each
random choice comes from a seeded ``random.Random``, so a failure reproduces.
"""

from __future__ import annotations

import collections
import json
import logging
import random
import re
import socket
import string
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import pytest
import trio

from tests.helpers import request_bytes, running_host
from tests.test_http_fuzz import mutated
from trio_gym.host import Host
from trio_gym.host.keys import Gone, KeyMemory
from trio_gym.host.stats import MAX_FOREIGN_LABELS, OTHER
from trio_gym.logs import LOGGER, JsonLinesFormatter
from trio_gym.protocol.control import CheckpointPhase
from trio_gym.protocol.host_identity import HOST_IDENTITY_HEADER
from trio_gym.protocol.rollouts import FAILURE_CLASS_KEY, NDJSON_MEDIA
from trio_gym.runners import ExampleContext
from trio_gym.runners.base import RecordedFailure
from trio_gym.trainer.status import parse_metrics

HANG_GUARD_S: Final = 240  # only a guard against a hang; no test asserts how long anything took
REQUEST_GUARD_S: Final = 20
MAX_REFUSAL_BYTES: Final = 2048
ID: Final = HOST_IDENTITY_HEADER
KEY: Final = "Idempotency-Key"
MAX_HEAD_BYTES: Final = 16 * 1024  # ServeConfig's default, which these hosts keep
FAR_FUTURE: Final = 4102444800.0  # 2100-01-01, seconds since the epoch: no clock needed
CONTROL: Final = "/control/v1/checkpoint/"
EVERY_STATUS: Final = frozenset(
    {0, 200, 400, 401, 403, 404, 405, 406, 408, 409, 410, 413, 421, 422, 431, 501, 503, 505}
)
"""What any request may be answered with (0: the connection closed without an answer). Never a
500: that is the host's own fault."""


def distinctive(rng: random.Random, prefix: str) -> str:
    """A string nothing else in a test contains by chance (letters of both cases and digits)."""
    alphabet = string.ascii_letters + string.digits
    return prefix + "".join(rng.choice(alphabet) for _ in range(28))


def secret_pattern(*secrets: str) -> re.Pattern[bytes]:
    """Matches any 8-character piece of ``secrets`` (any longer piece holds one)."""
    pieces = sorted({s[i : i + 8] for s in secrets for i in range(len(s) - 7)})
    return re.compile(b"|".join(re.escape(piece.encode()) for piece in pieces))


def batch(mark: str, count: int = 1, *, pause_s: float | None = None) -> bytes:
    """A batch whose examples carry ``mark``, which the :class:`Recorder` counts when one runs
    (and how long each pauses there, if not the runner's own pause)."""
    example: dict[str, Any] = {"_mark": mark}
    if pause_s is not None:
        example["_pause"] = pause_s
    return json.dumps({"examples": [example] * count}).encode()


def chunked(body: bytes, pieces: int = 2) -> bytes:
    """``body`` under chunked transfer coding, in ``pieces`` chunks, with its last chunk."""
    step = max(1, -(-len(body) // pieces))
    parts = [body[at : at + step] for at in range(0, len(body), step)]
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


def post(
    body: bytes,
    headers: Sequence[tuple[str, str]] = (),
    *,
    version: str = "1.1",
    chunks: bool = False,
    target: str = "/rollouts/run",
) -> bytes:
    if chunks:
        te = [*headers, ("Transfer-Encoding", "chunked")]
        return request_bytes(
            chunked(body), headers=te, version=version, target=target, content_length=False
        )
    return request_bytes(body, headers=headers, version=version, target=target)


def get(target: str, headers: Sequence[tuple[str, str]] = (), method: str = "GET") -> bytes:
    return request_bytes(method=method, target=target, headers=headers)


def control(operation: str, headers: Sequence[tuple[str, str]]) -> bytes:
    """A control-plane operation under checkpoint ``c1``, with a deadline that never passes."""
    call = json.dumps({"checkpoint_id": "c1", "deadline": FAR_FUTURE}).encode()
    return post(call, headers, target=f"{CONTROL}{operation}")


def with_header(request: bytes, name: bytes, value: bytes) -> bytes:
    """``request`` with one more header line, ``name: value``, its bytes as given (CR, LF, NUL
    and all), last among the headers."""
    head, _, body = request.partition(b"\r\n\r\n")
    return head + b"\r\n" + name + b": " + value + b"\r\n\r\n" + body


class Recorder:
    """A runner that counts the ``_mark`` of every example it runs, how many batches had an
    example running at once (its own view of the batch limit) and the host's count of running
    batches at each start; each example pauses ``pause_s`` (or its own ``_pause``) and returns
    a small result."""

    def __init__(self, pause_s: float = 0.0) -> None:
        self.pause_s = pause_s
        self.marks: collections.Counter[str] = collections.Counter()
        self.running: collections.Counter[str] = collections.Counter()
        self.peak_batches = 0
        self.host: Host | None = None
        self.peak_counted = 0

    def check_example(self, example: Mapping[str, Any]) -> None:
        unknown = {key for key in example if not key.startswith("_")} - {"class"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        mark = example.get("_mark")
        self.marks[mark if isinstance(mark, str) else repr(mark)] += 1
        self.running[context.batch_id] += 1
        self.peak_batches = max(self.peak_batches, len(self.running))
        if self.host is not None:
            counted = self.host.services.stats.batches_running
            self.peak_counted = max(self.peak_counted, counted)
        pause = example.get("_pause")
        try:
            await trio.sleep(pause if isinstance(pause, int | float) else self.pause_s)
        finally:
            self.running[context.batch_id] -= 1
            if not self.running[context.batch_id]:
                del self.running[context.batch_id]
        return {"ran": True}


class FailingRunner:
    """Fails every example with the environment's own record, of the class the example names."""

    def check_example(self, example: Mapping[str, Any]) -> None:
        pass

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        await trio.lowlevel.checkpoint()
        record = {FAILURE_CLASS_KEY: example["class"], "why": "scripted"}
        raise RecordedFailure("the environment failed", record)


class LogWatch(logging.Handler):
    """Every ``trio_gym`` record as the JSON line the host would write (fields included):
    counted, and kept when it holds a piece of a secret or is an error."""

    def __init__(self, secrets: re.Pattern[bytes]) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonLinesFormatter())
        self.secrets = re.compile(secrets.pattern.decode())
        self.lines = 0
        self.leaks: list[str] = []
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record)
        self.lines += 1
        if self.secrets.search(line):
            self.leaks.append(line[:1000])
        if record.levelno >= logging.ERROR:
            self.errors.append(line[:3000])


@contextmanager
def watching_logs(secrets: re.Pattern[bytes]) -> Iterator[LogWatch]:
    """The ``trio_gym`` logger's records, at every level, to a :class:`LogWatch` alone."""
    watch = LogWatch(secrets)
    handlers, level, propagate = list(LOGGER.handlers), LOGGER.level, LOGGER.propagate
    for handler in handlers:
        LOGGER.removeHandler(handler)
    LOGGER.addHandler(watch)
    LOGGER.setLevel(logging.DEBUG)
    LOGGER.propagate = False
    try:
        yield watch
    finally:
        LOGGER.removeHandler(watch)
        for handler in handlers:
            LOGGER.addHandler(handler)
        LOGGER.setLevel(level)
        LOGGER.propagate = propagate


# --- the wire, raw ----------------------------------------------------------------------------


async def connected(port: int) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    try:
        await sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


async def send_and_read(sock: trio.socket.SocketType, data: bytes) -> bytes:
    """Send ``data``, end our side, and read everything until the host closes (a reset ends the
    read too: what arrived before it is the answer)."""
    try:
        await send_all(sock, data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # the host answered and closed before it took all of it
        pass
    received = bytearray()
    try:
        while chunk := await sock.recv(65536):
            received += chunk
    except OSError:
        pass
    return bytes(received)


async def status_of(port: int, data: bytes) -> int:
    """The status ``data`` is answered with, read from the answer's head alone (the connection
    is closed then, whatever its body would have been)."""
    sock = await connected(port)
    with sock:
        await send_all(sock, data)
        head = b""
        while b"\r\n\r\n" not in head and (chunk := await sock.recv(65536)):
            head += chunk
    return parse_answer(head.partition(b"\r\n\r\n")[0] + b"\r\n\r\n", head_request=True).status


async def send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view) :]


async def raw_exchange(port: int, data: bytes) -> bytes:
    """``data`` on a fresh connection; everything the host wrote back until it closed."""
    sock = await connected(port)
    with sock:
        return await send_and_read(sock, data)


@attrs.frozen
class Answer:
    """A response as the bytes say: ``status`` 0 when the connection closed with none."""

    status: int
    headers: dict[str, str] = attrs.field(factory=dict)
    body: bytes = b""
    framed: bool = True
    """Complete as its Content-Length or its chunked coding says (never close-delimited)."""
    after: bytes = b""
    """Bytes after the answer's end: a second answer would be here."""

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str:
        return self._error("code")

    @property
    def message(self) -> str:
        return self._error("message")

    def _error(self, field: str) -> str:
        """A field of the error envelope; empty when the body is not one."""
        try:
            return str(self.json()["error"][field])
        except (ValueError, KeyError, TypeError):
            return ""


_STATUS_LINE: Final = re.compile(rb"HTTP/1\.[01] ([0-9]{3}) [^\r\n]*")


def _dechunked(data: bytes) -> tuple[bytes, bytes, bool]:
    """(body, what follows it, whether it ended as chunked coding ends)."""
    body, at = bytearray(), 0
    while True:
        end = data.find(b"\r\n", at)
        if end < 0:
            return bytes(body), b"", False
        try:
            size = int(data[at:end], 16)
        except ValueError:
            return bytes(body), b"", False
        at = end + 2
        if size == 0:
            if data[at : at + 2] != b"\r\n":
                return bytes(body), b"", False
            return bytes(body), data[at + 2 :], True
        if data[at + size : at + size + 2] != b"\r\n":
            return bytes(body), b"", False
        body += data[at : at + size]
        at += size + 2


def parse_answer(raw: bytes, *, head_request: bool = False) -> Answer:
    """The first final response in ``raw`` (interim 1xx ones skipped), and what followed it.
    Not h11: answers h11 wrote are judged by a reader that is not h11, strict on framing."""
    rest = raw
    while True:
        if not rest:
            return Answer(0)
        head, separator, rest = rest.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status_line = _STATUS_LINE.fullmatch(lines[0])
        if not separator or status_line is None:
            return Answer(-1, body=raw, framed=False)
        headers = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon:
                return Answer(-1, body=raw, framed=False)
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        status = int(status_line[1])
        if status >= 200:
            break
    if "content-length" in headers:
        if not headers["content-length"].isdigit():
            return Answer(status, headers, rest, framed=False)
        length = 0 if head_request else int(headers["content-length"])
        return Answer(status, headers, rest[:length], len(rest) >= length, rest[length:])
    if headers.get("transfer-encoding") == "chunked":
        body, after, ended = _dechunked(rest)
        return Answer(status, headers, body, ended, after)
    return Answer(status, headers, rest, framed=False)


def problems_with(answer: Answer, secrets: re.Pattern[bytes], raw: bytes) -> list[str]:
    """What is wrong with any answer, whatever was asked."""
    problems = []
    if not answer.framed:
        problems.append("not framed by Content-Length or chunked coding")
    if answer.after:
        problems.append(f"{len(answer.after)} bytes after the answer")
    if answer.status not in EVERY_STATUS:
        problems.append(f"status {answer.status}")
    if answer.status > 0 and answer.headers.get("connection") != "close":
        problems.append("no Connection: close")
    if answer.status not in (0, 200) and len(answer.body) > MAX_REFUSAL_BYTES:
        problems.append(f"a refusal of {len(answer.body)} bytes")
    if secrets.search(raw):
        problems.append("a piece of the identity or the token in the answer")
    return problems


async def health_and_a_fresh_batch(port: int, identity: str, runner: Recorder) -> None:
    """The host still serves: ``/health`` is ready to the holder, and a new batch runs."""
    with trio.fail_after(REQUEST_GUARD_S):
        health = parse_answer(await raw_exchange(port, get("/health", [(ID, identity)])))
        fresh = parse_answer(await raw_exchange(port, post(batch("fresh"), [(ID, identity)])))
    assert health.status == 200 and health.json()["status"] == "ready", health
    assert fresh.status == 200 and fresh.json()["results"][0]["ran"] is True, fresh
    assert runner.marks["fresh"] == 1


# --- 1. the fuzz --------------------------------------------------------------------------------


@attrs.frozen
class Case:
    kind: str
    data: bytes
    expected: frozenset[int] | None = None
    """The statuses this exact request may get (``None``: any of :data:`EVERY_STATUS`)."""
    names: str = ""
    """What the refusal's message must name (a header, a rule)."""
    key: str = ""
    """A flooded POST's key."""


FUZZ_REQUESTS: Final = 100_000
FUZZ_CONNECTIONS: Final = 64
FUZZ_MAX_BATCHES: Final = 8
FUZZ_GRACE_S: Final = 0.5
FUZZ_RETENTION_S: Final = 1.0
FLOOD_KEYS: Final = 4000
OK_OR_BUSY: Final = frozenset({200, 503})


def _bad_bytes(rng: random.Random, value: bytes) -> tuple[str, bytes]:
    """``value`` broken one way a header value cannot carry, or made too long; and how."""
    at = rng.randrange(1, len(value))
    how = rng.choice(["cr", "nul", "lf", "vt-ff", "high", "ctl", "long", "huge"])
    inserted = {
        "cr": b"\r",
        "nul": b"\x00",
        "lf": b"\n",
        "vt-ff": rng.choice([b"\x0b", b"\x0c"]),  # whitespace h11 refuses inside a value
        "high": bytes([rng.randrange(0x80, 0x100)]),
        "ctl": bytes([rng.choice([0x01, 0x08, 0x1B, 0x7F])]),  # h11 lets these through
    }
    if how == "long":
        return how, value + b"a" * rng.randrange(300, MAX_HEAD_BYTES - 2000)
    if how == "huge":
        return how, value + b"b" * rng.randrange(MAX_HEAD_BYTES + 100, 2 * MAX_HEAD_BYTES)
    return how, value[:at] + inserted[how] + value[at:]


_MALFORMED: Final = frozenset({"cr", "nul", "vt-ff"})
"""Header values h11 refuses whole, naming the header (it lets other control bytes through)."""


def echoable(request: bytes) -> bytes:
    """What of ``request`` the host may show back, bounded: its request line, its header names
    and its Idempotency-Key values (never another header's value). A mutation that moves a
    piece of the identity there has published it itself: the fuzz draws another instead."""
    lines = request.split(b"\r\n\r\n", 1)[0].split(b"\n")
    shown, in_key = [lines[0]], False
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):  # an obs-fold: the line before it goes on
            if in_key:
                shown.append(line)
            continue
        name, colon, value = line.partition(b":")
        in_key = bool(colon) and name.strip().lower() == KEY.lower().encode()
        if colon:
            shown.append(name)
        if in_key:
            shown.append(value)
    return b"\n".join(shown)


def hostile_requests(
    rng: random.Random, identity: str, token: str, k: str, count: int
) -> Iterator[Case]:
    """``count`` requests, in a fixed order for a given ``rng``: mutated valid requests of every
    kind, exact ones with the statuses they must get, garbage, broken identity, Authorization
    and Idempotency-Key lines, floods of keyed POSTs and DELETEs over a pool of keys, and
    requests under ``k``, whose batch ran and expired before."""
    wrong = distinctive(rng, "wrong-")
    secrets = secret_pattern(identity, token)
    auth = f"Bearer {token}"
    me = (ID, identity)
    pool = [distinctive(rng, f"f{n}-")[:24] for n in range(FLOOD_KEYS)]

    def key() -> str:
        return distinctive(rng, "m-")

    templates: list[tuple[str, Callable[[], bytes], frozenset[int]]] = [
        ("post", lambda: post(batch("fz", rng.randrange(1, 4)), [me]), OK_OR_BUSY),
        ("post-keyed", lambda: post(batch("fz"), [me, (KEY, key())]), OK_OR_BUSY),
        (
            "post-rows",
            lambda: post(batch("fz", 2), [me, ("Accept", NDJSON_MEDIA)]),
            OK_OR_BUSY,
        ),
        (
            "post-rows-keyed",
            lambda: post(batch("fz"), [me, ("Accept", NDJSON_MEDIA), (KEY, key())]),
            OK_OR_BUSY,
        ),
        ("post-1.0", lambda: post(batch("fz"), [me], version="1.0"), OK_OR_BUSY),
        (
            "post-1.0-keyed",
            lambda: post(batch("fz"), [me, (KEY, key())], version="1.0"),
            OK_OR_BUSY,
        ),
        (
            "post-chunked-keyed",
            lambda: post(batch("fz"), [me, (KEY, key())], chunks=True),
            OK_OR_BUSY,
        ),
        ("post-stranger", lambda: post(batch("fz"), [(KEY, key())]), frozenset({403})),
        ("post-wrong-host", lambda: post(batch("fz"), [(ID, wrong)]), frozenset({421})),
        ("delete", lambda: get("/rollouts/run", [me, (KEY, key())], "DELETE"), frozenset({200})),
        (
            "delete-stranger",
            lambda: get("/rollouts/run", [(KEY, key())], "DELETE"),
            frozenset({403}),
        ),
        ("metrics", lambda: get("/metrics", [me]), frozenset({200})),
        ("metrics-stranger", lambda: get("/metrics"), frozenset({403})),
        ("health", lambda: get("/health", [me]), OK_OR_BUSY),
        ("health-stranger", lambda: get("/health"), OK_OR_BUSY),
        ("options", lambda: get("*", [me], "OPTIONS"), frozenset({200})),
        (
            "control-status",
            lambda: get(f"{CONTROL}status", [me, ("Authorization", auth)]),
            frozenset({200}),
        ),
        (
            "control-status-wrong-token",
            lambda: get(f"{CONTROL}status", [me, ("Authorization", f"Bearer {wrong}")]),
            frozenset({401}),
        ),
        (
            "control-prepare-wrong-token",
            lambda: control("prepare", [me, ("Authorization", f"Bearer {token[:-1]}")]),
            frozenset({401}),
        ),
        (
            "control-resume",
            lambda: control("resume", [me, ("Authorization", auth)]),
            frozenset({200}),
        ),
        (
            "control-renew",
            lambda: control("renew", [me, ("Authorization", auth)]),
            frozenset({409}),
        ),
        (
            "control-stranger",
            lambda: get(f"{CONTROL}status", [("Authorization", auth)]),
            frozenset({403}),
        ),
    ]
    weights = [8, 8, 3, 3, 3, 2, 3, 3, 3, 3, 2, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1]
    k_body = batch("K")
    k_requests = [
        ("K-retry", post(k_body, [me, (KEY, k)]), frozenset({410})),
        ("K-other-body", post(batch("K", 2), [me, (KEY, k)]), frozenset({410})),
        ("K-rows", post(k_body, [me, (KEY, k), ("Accept", NDJSON_MEDIA)]), frozenset({410})),
        ("K-1.0", post(k_body, [me, (KEY, k)], version="1.0"), frozenset({410})),
        ("K-chunked", post(k_body, [me, (KEY, k)], chunks=True), frozenset({410})),
        ("K-delete", get("/rollouts/run", [me, (KEY, k)], "DELETE"), frozenset({200})),
        ("K-stranger", post(k_body, [(KEY, k)]), frozenset({403})),
    ]
    for _ in range(count):
        roll = rng.random()
        if roll < 0.50:
            kind, make, _ = rng.choices(templates, weights)[0]
            data = mutated(rng, make())
            while secrets.search(echoable(data)):
                data = mutated(rng, make())
            yield Case(f"mutated-{kind}", data)
        elif roll < 0.58:
            kind, make, expected = rng.choices(templates, weights)[0]
            yield Case(kind, make(), expected)
        elif roll < 0.62:
            yield _long_echo(rng, me)
        elif roll < 0.64:
            data = rng.randbytes(rng.randrange(1, 3000))
            if rng.random() < 0.3:  # garbage after a head that looks right
                data = b"POST /rollouts/run HTTP/1.1\r\nHost: t\r\n" + data
            yield Case("garbage", data)
        elif roll < 0.76:
            yield _attack(rng, identity, token, me)
        elif roll < 0.94:
            flood = rng.choice(pool)
            if rng.random() < 0.7:
                body = batch(f"flood:{flood}")
                sent = post(body, [me, (KEY, flood)])
                yield Case("flood-post", sent, frozenset({200, 410, 503}), key=flood)
            else:
                delete = get("/rollouts/run", [me, (KEY, flood)], "DELETE")
                yield Case("flood-delete", delete, frozenset({200}))
        else:
            kind, data, expected = rng.choice(k_requests)
            yield Case(kind, data, expected)


def _long_echo(rng: random.Random, me: tuple[str, str]) -> Case:
    """A request whose refusal shows what it sent — its path or its method — made long: the
    echo must stay bounded."""
    long = (distinctive(rng, "") * 430)[: rng.randrange(200, 12_000)]
    which = rng.choice(["path", "absolute", "method"])
    if which == "path":
        return Case("echo-path", get(f"/{long}", [me]), frozenset({404}))
    if which == "absolute":
        return Case("echo-absolute", get(f"http://h/{long}", [me]), frozenset({404}))
    return Case("echo-method", get("/health", [me], method=long.upper()), frozenset({405}))


def _attack(rng: random.Random, identity: str, token: str, me: tuple[str, str]) -> Case:
    """A header line of the identity, the Authorization or the Idempotency-Key broken or made
    too long; its request carries the mark ``attack``, which never runs."""
    target = rng.choice(["identity", "authorization", "key"])
    if target == "identity":
        how, value = _bad_bytes(rng, identity.encode())
        base = rng.choice(
            [
                post(batch("attack"), [(KEY, distinctive(rng, "a-"))]),
                get("/health"),
                get(f"{CONTROL}status", [("Authorization", f"Bearer {token}")]),
            ]
        )
        refused = {"lf": 400, "huge": 431}.get(how, 400 if how in _MALFORMED else 421)
        names = ID if how in _MALFORMED else ""
        broken = with_header(base, ID.encode(), value)
        return Case(f"attack-identity-{how}", broken, frozenset({refused}), names)
    if target == "authorization":
        how, value = _bad_bytes(rng, f"Bearer {token}".encode())
        base = get(f"{CONTROL}status", [me])
        refused = {"lf": 400, "huge": 431}.get(how, 400 if how in _MALFORMED else 401)
        if b"\n " in value:  # an obs-fold, which h11 unfolds: the token is whole again
            refused = 200
        names = "authorization" if how in _MALFORMED else ""
        broken = with_header(base, b"Authorization", value)
        return Case(f"attack-token-{how}", broken, frozenset({refused}), names)
    how, value = _bad_bytes(rng, distinctive(rng, "k-").encode())
    base = rng.choice([post(batch("attack"), [me]), get("/rollouts/run", [me], "DELETE")])
    refused = 431 if how == "huge" else 400
    names = {"lf": "", "huge": ""}.get(how, KEY if how in _MALFORMED else "Idempotency-Key must be")
    broken = with_header(base, KEY.encode(), value)
    return Case(f"attack-key-{how}", broken, frozenset({refused}), names)


@attrs.define
class Peaks:
    batches_running: int = 0
    keyed_running: int = 0
    keyed_finished: int = 0
    samples: int = 0


async def sample_peaks(host: Host, peaks: Peaks) -> None:
    """Look at the host's counts every millisecond or so, keeping the largest seen."""
    stats, keyed = host.services.stats, host.services.keyed
    while True:
        peaks.batches_running = max(peaks.batches_running, stats.batches_running)
        peaks.keyed_running = max(peaks.keyed_running, len(keyed._batches) - len(keyed._finished))
        peaks.keyed_finished = max(peaks.keyed_finished, len(keyed._finished))
        peaks.samples += 1
        await trio.sleep(0.001)


@attrs.define
class FuzzReport:
    """What the fuzz's clients saw: statuses, connections closed unanswered (by kind of
    request), what was wrong, requests that hung, flooded keys whose answer was cut (a flood
    DELETE gave the batch up while it ran: the host's memory must say so), and how long the
    requests took."""

    counts: dict[int, int] = attrs.field(factory=dict)
    closed: dict[str, int] = attrs.field(factory=dict)
    violations: list[str] = attrs.field(factory=list)
    hung: list[str] = attrs.field(factory=list)
    cut: list[str] = attrs.field(factory=list)
    seconds: float = 0.0


async def fuzz_clients(
    port: int, identity: str, token: str, k: str, seed: int, count: int
) -> FuzzReport:
    """Send :func:`hostile_requests` to ``port``, ``FUZZ_CONNECTIONS`` connections at a time,
    each request on a fresh one under its own guard, and judge every answer."""
    secrets = secret_pattern(identity, token)
    report = FuzzReport()
    counts: collections.Counter[int] = collections.Counter()
    closed: collections.Counter[str] = collections.Counter()
    cases = hostile_requests(random.Random(seed), identity, token, k, count)

    def judge(case: Case, raw: bytes) -> None:
        answer = parse_answer(raw, head_request=case.data.startswith(b"HEAD "))
        counts[answer.status] += 1
        if answer.status == 0:
            closed[case.kind] += 1
        if case.kind == "flood-post" and answer.status == 200 and not answer.framed:
            report.cut.append(case.key)
            answer = attrs.evolve(answer, framed=True)  # cut, not ended as if whole: right
        problems = problems_with(answer, secrets, raw)
        if case.expected is not None and answer.status not in case.expected:
            problems.append(f"status {answer.status}, not one of {sorted(case.expected)}")
        if case.names and case.names.lower() not in answer.message.lower():
            problems.append(f"the message does not name {case.names!r}")
        if problems:
            report.violations.append(
                f"{case.kind}: {problems}; sent {case.data[:300]!r}; got {raw[:300]!r}"
            )

    async def connection_after_connection() -> None:
        for case in cases:  # one shared iterator: the order is the seed's
            try:
                with trio.fail_after(REQUEST_GUARD_S):
                    raw = await raw_exchange(port, case.data)
            except trio.TooSlowError:
                report.hung.append(f"{case.kind}: {case.data[:300]!r}")
                continue
            judge(case, raw)

    started = trio.current_time()
    async with trio.open_nursery() as clients:
        for _ in range(FUZZ_CONNECTIONS):
            clients.start_soon(connection_after_connection)
    report.seconds = trio.current_time() - started
    report.counts, report.closed = dict(counts), dict(closed)
    return report


def fuzz_clients_main(params: str) -> None:
    """:func:`fuzz_clients` in a process of its own, its report printed as JSON: the clients
    take the machine's second core, the host keeps the first."""
    report = trio.run(partial(fuzz_clients, **json.loads(params)))
    print(json.dumps(attrs.asdict(report)))


ROOT: Final = Path(__file__).resolve().parent.parent
CLIENTS: Final = "import sys; from tests.test_hostile import fuzz_clients_main as m; m(sys.argv[1])"


async def test_100000_hostile_requests_leave_the_host_serving_bounded_and_discreet() -> None:
    """100,000 requests on fresh connections, 64 at a time (from a process of their own),
    against a host with an identity, a control token and room for 8 batches: mutated requests
    of every kind, exact ones, garbage, broken secret-bearing header lines, floods of keyed
    POSTs and DELETEs, retries of a key whose answer expired before, and long paths and methods
    to echo. Each is answered well framed with an allowed status (an exact request with the one
    it must get), or its connection is closed (a flooded batch a DELETE gave up is cut, which
    the host's memory confirms); no refusal is large; no answer and no log line holds a piece
    of the identity or the token; the expired key's batch never runs again, no flooded key runs
    twice, no broken header line runs anything, no more than 8 batches ever run at once; and
    afterwards every example has ended and the host still serves."""
    rng = random.Random(20260704)
    identity, token = distinctive(rng, "I-"), distinctive(rng, "T-")
    k = distinctive(rng, "K-")
    secrets = secret_pattern(identity, token)
    runner = Recorder(pause_s=0.002)
    overrides: dict[str, Any] = {
        "host_identity": identity,
        "control_token": token,
        "max_batches": FUZZ_MAX_BATCHES,
        "reattach_grace_s": FUZZ_GRACE_S,
        "answer_retention_s": FUZZ_RETENTION_S,
    }
    peaks = Peaks()
    with watching_logs(secrets) as logs:
        async with running_host(runner=runner, **overrides) as (host, port):
            runner.host = host
            stats, kept = host.services.stats, host.services.keyed
            # K: a batch that ran, whose answer is no longer kept.
            with trio.fail_after(REQUEST_GUARD_S):
                ran = await raw_exchange(port, post(batch("K"), [(ID, identity), (KEY, k)]))
            assert parse_answer(ran).status == 200 and runner.marks["K"] == 1
            await trio.sleep(FUZZ_RETENTION_S + FUZZ_GRACE_S)
            with trio.fail_after(REQUEST_GUARD_S):
                gone = await raw_exchange(port, post(batch("K"), [(ID, identity), (KEY, k)]))
            assert parse_answer(gone).status == 410, gone

            params = {"port": port, "identity": identity, "token": token, "k": k}
            params |= {"seed": rng.randrange(1 << 32), "count": FUZZ_REQUESTS}
            started = trio.current_time()
            with trio.fail_after(HANG_GUARD_S):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sample_peaks, host, peaks)
                    clients = await trio.run_process(
                        [sys.executable, "-c", CLIENTS, json.dumps(params)],
                        cwd=ROOT,
                        capture_stdout=True,
                        capture_stderr=True,
                        check=False,
                    )
                    nursery.cancel_scope.cancel()
            seconds = trio.current_time() - started
            assert clients.returncode == 0, clients.stderr.decode()[-5000:]
            report = FuzzReport(**json.loads(clients.stdout))
            counts = {int(status): n for status, n in report.counts.items()}
            with trio.fail_after(REQUEST_GUARD_S):
                await stats.batch_changes.until(lambda: stats.batches_running == 0)
            cut = {key: kept.memory.why(key, trio.current_time()) for key in report.cut}
            await health_and_a_fresh_batch(port, identity, runner)
            phase = host.services.checkpoints.phases.phase
            running = stats.examples_running
    total = sum(counts.values())
    print(
        f"\nhostile fuzz: {total} requests in {report.seconds:.1f} s "
        f"({total / report.seconds:.0f}/s; {seconds:.1f} s with the clients' process); "
        f"statuses {dict(sorted(counts.items()))}; closed without an answer "
        f"{counts.get(0, 0)} {report.closed}; {len(cut)} flooded answers cut by a DELETE; "
        f"{logs.lines} log lines; peak batches {peaks.batches_running} (runner "
        f"{runner.peak_batches}); {len(report.violations)} violations, {len(report.hung)} hung"
    )
    assert total == FUZZ_REQUESTS and not report.hung, report.hung[:5]
    assert not report.violations, report.violations[:5]
    assert 500 not in counts
    assert set(cut.values()) <= {Gone.GIVEN_UP}, cut  # a cut answer: its batch was given up
    assert not logs.leaks, logs.leaks[:3]
    assert not logs.errors, logs.errors[:3]
    assert runner.marks["K"] == 1  # the expired key's batch never ran again
    assert runner.marks["attack"] == 0  # no broken identity, token or key line ran anything
    floods = {mark: n for mark, n in runner.marks.items() if mark.startswith("flood:")}
    assert floods and max(floods.values()) == 1, sorted(floods.items(), key=lambda i: -i[1])[:5]
    assert peaks.samples > 100 and peaks.batches_running <= FUZZ_MAX_BATCHES
    assert runner.peak_counted <= FUZZ_MAX_BATCHES and runner.peak_batches <= FUZZ_MAX_BATCHES
    assert running == 0 and phase is CheckpointPhase.IDLE
    assert {200, 400, 403, 410, 421, 503} <= set(counts)  # the mix reached every rule


# --- 2. framing and smuggling -------------------------------------------------------------------


def framing_tricks(identity: str) -> list[tuple[str, bytes, int]]:
    """(name, bytes, the status of the one answer) for each trick: every request hidden inside
    is a ``POST /rollouts/run`` holding the identity, with an example marked ``smuggled:name``;
    an outer batch, where there is one, is marked ``outer``."""
    me = f"{ID}: {identity}\r\n".encode()
    outer = batch("outer")
    tricks: list[tuple[str, bytes, int]] = []

    def trick(name: str, build: Callable[[bytes], bytes], status: int) -> None:
        tricks.append((name, build(post(batch(f"smuggled:{name}"), [(ID, identity)])), status))

    def head(*lines: bytes, target: bytes = b"/rollouts/run", version: bytes = b"1.1") -> bytes:
        first = b"POST " + target + b" HTTP/" + version + b"\r\nHost: t\r\n" + me
        return first + b"".join(line + b"\r\n" for line in lines) + b"\r\n"

    def length(body: bytes) -> bytes:
        return b"Content-Length: %d" % len(body)

    te = b"Transfer-Encoding: chunked"

    def coded(coding: bytes, hidden: bytes) -> bytes:
        return head(b"Transfer-Encoding: " + coding) + chunked(outer) + hidden

    def sized(length_format: bytes, hidden: bytes) -> bytes:
        return head(b"Content-Length: " + length_format % len(outer)) + outer + hidden

    trick("cl-then-te", lambda s: head(length(chunked(outer)), te) + chunked(outer) + s, 400)
    trick("te-then-cl", lambda s: head(te, length(chunked(outer))) + chunked(outer) + s, 400)
    trick("cl-and-te-zero-chunk", lambda s: head(b"Content-Length: 5", te) + b"0\r\n\r\n" + s, 400)
    trick(
        "two-different-lengths",
        lambda s: head(length(outer), length(outer + s)) + outer + s,
        400,
    )
    trick("two-equal-lengths", lambda s: head(length(outer), length(outer)) + outer + s, 200)
    trick(
        "length-list",
        lambda s: head(b"Content-Length: %d, %d" % (len(outer), len(outer))) + outer + s,
        200,  # one length, said twice (RFC 9110 §8.6)
    )
    for name, value in [
        ("te-chunked-identity", b"chunked, identity"),
        ("te-identity-chunked", b"identity, chunked"),
        ("te-xchunked", b"xchunked"),
        ("te-chunked-x", b"chunked-x"),
        ("te-gzip-chunked", b"gzip, chunked"),
    ]:
        trick(name, partial(coded, value), 501)
    trick("te-twice", lambda s: head(te, te) + chunked(outer) + s, 501)
    trick(
        "te-chunked-then-identity",
        lambda s: head(te, b"Transfer-Encoding: identity") + chunked(outer) + s,
        501,
    )
    trick("te-space-before-colon", lambda s: head(b"Transfer-Encoding : chunked") + s, 400)
    trick(
        "te-obs-folded", lambda s: head(b"Transfer-Encoding:\r\n chunked") + chunked(outer) + s, 200
    )
    trick("te-vertical-tab", lambda s: head(b"Transfer-Encoding:\x0bchunked") + s, 400)
    trick("te-upper-case", lambda s: head(b"Transfer-Encoding: CHUNKED") + chunked(outer) + s, 200)
    for name, value in [
        ("cl-plus", b"+%d"),
        ("cl-negative", b"-%d"),
        ("cl-hex", b"0x%x"),
        ("cl-underscore", b"%d_0"),
        ("cl-trailing-junk", b"%d;x"),
    ]:
        trick(name, partial(sized, value), 400)
    trick(
        "cl-with-spaces-and-tabs",
        lambda s: head(b"Content-Length: \t %d \t" % len(outer)) + outer + s,
        200,
    )
    trick(
        "chunk-extension",
        lambda s: head(te) + b'%x;name="v"\r\n%s\r\n0\r\n\r\n' % (len(outer), outer) + s,
        200,
    )
    trick("chunk-size-overflow", lambda s: head(te) + b"f" * 40 + b"\r\n" + outer + s, 400)
    trick("chunk-size-negative", lambda s: head(te) + b"-1\r\n" + outer + s, 400)
    trick("chunk-size-0x", lambda s: head(te) + b"0x%x\r\n" % len(outer) + outer + s, 400)
    trick("chunk-size-junk", lambda s: head(te) + b"%xg\r\n" % len(outer) + outer + s, 400)
    trick(
        "chunk-longer-than-its-size",
        lambda s: head(te) + b"%x\r\n" % len(outer) + outer + s + b"\r\n0\r\n\r\n",
        400,
    )
    trick(
        "chunk-size-covering-the-request",
        lambda s: head(te) + b"%x\r\n%s%s\r\n0\r\n\r\n" % (len(outer + s), outer, s),
        400,
    )
    trick("last-chunk-first", lambda s: head(te) + b"0\r\n\r\n" + s, 400)
    trick(
        "trailer-then-request",
        lambda s: head(te) + chunked(outer)[:-2] + b"X-Trailer: y\r\n\r\n" + s,
        200,
    )
    trick(
        "behind-a-health-check",
        lambda s: (
            b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: keep-alive\r\n" + me + b"\r\n" + s
        ),
        200,
    )
    trick(
        "behind-a-complete-batch",
        lambda s: head(b"Connection: keep-alive", length(outer)) + outer + s,
        200,
    )
    trick(
        "in-a-body-shorter-than-its-length",
        lambda s: head(b"Content-Length: %d" % (len(outer + s) + 10)) + outer + s,
        400,
    )
    trick(
        "in-the-body-of-a-get",
        lambda s: b"GET /health HTTP/1.1\r\nHost: t\r\n" + me + length(s) + b"\r\n\r\n" + s,
        200,
    )
    trick(
        "in-the-body-of-a-delete",
        lambda s: (
            b"DELETE /rollouts/run HTTP/1.1\r\nHost: t\r\n"
            + me
            + b"Idempotency-Key: del-1\r\n"
            + length(s)
            + b"\r\n\r\n"
            + s
        ),
        200,
    )
    trick("as-the-body", lambda s: head(length(s)) + s, 400)
    trick(
        "http-1.0-chunked",
        lambda s: head(te, version=b"1.0") + chunked(outer) + s,
        200,  # read as chunked, and the connection closed after it (RFC 9112 §6.1)
    )
    trick(
        "absolute-form-to-another-host",
        lambda s: head(length(outer), target=b"http://elsewhere.example/rollouts/run") + outer + s,
        200,
    )
    trick(
        "lf-only-line-ends",
        lambda s: head(length(outer)).replace(b"\r\n", b"\n") + outer + s,
        200,
    )
    trick(
        "cr-only-line-ends", lambda s: head(length(outer)).replace(b"\r\n", b"\r") + outer + s, 400
    )
    trick(
        "nul-in-the-request-line",
        lambda s: head(length(outer), target=b"/rollouts/run\x00") + outer + s,
        400,
    )
    trick(
        "two-spaces-in-the-request-line", lambda s: b"POST  /rollouts/run HTTP/1.1\r\n\r\n" + s, 400
    )
    trick("http-0.9", lambda s: b"GET /health\r\n\r\n" + s, 400)
    trick(
        "expect-continue-then-the-request",
        lambda s: head(b"Expect: 100-continue", length(s)) + s,
        400,
    )
    trick("a-huge-length", lambda s: head(b"Content-Length: 99999999999999") + s, 413)
    trick("options-star", lambda s: b"OPTIONS * HTTP/1.1\r\nHost: t\r\n" + me + b"\r\n" + s, 200)
    return tricks


async def test_no_smuggled_request_runs_and_each_framing_trick_gets_one_framed_answer() -> None:
    """Two lengths, a length and a chunked coding, codings h11 does not speak, folded and
    broken headers, chunk sizes that overflow, go negative or carry junk, requests pipelined
    behind complete ones or carried in bodies longer than their length, HTTP/1.0 with chunks,
    absolute-form targets, LF-only lines, NUL in the request line: each connection gets exactly
    one well-framed answer, with the status its outer request earns, and no request hidden
    inside ever runs; the host serves afterwards."""
    rng = random.Random(36)
    identity = distinctive(rng, "I-")
    secrets = secret_pattern(identity)
    runner = Recorder()
    tricks = framing_tricks(identity)
    wrong: list[str] = []
    async with running_host(runner=runner, host_identity=identity) as (host, port):
        runner.host = host
        for name, data, status in tricks:
            with trio.fail_after(REQUEST_GUARD_S):
                raw = await raw_exchange(port, data)
            answer = parse_answer(raw)
            problems = problems_with(answer, secrets, raw)
            if answer.status != status:
                problems.append(f"status {answer.status}, not {status}: {answer.message}")
            if problems:
                wrong.append(f"{name}: {problems}")
        await health_and_a_fresh_batch(port, identity, runner)
    smuggled = {mark: n for mark, n in runner.marks.items() if mark.startswith("smuggled:")}
    assert len(tricks) >= 40
    assert not smuggled, smuggled
    assert not wrong, wrong
    assert set(runner.marks) == {"outer", "fresh"}  # the outer batches ran, as they should


# --- 3. scrape storms and failure classes -------------------------------------------------------

SCRAPES: Final = 800
SCRAPE_CAP: Final = 640
"""Its overflow is a quarter of it, 160: the 800 scrapes fill both, and one more is dropped."""


async def test_eight_hundred_concurrent_scrapes_are_all_answered_those_over_the_cap_too() -> None:
    """800 connections held open at once against a cap of 640: 640 are served, 160 wait in the
    overflow, and one more is closed unanswered; then all 800 scrape /metrics, and every one —
    over the cap too, as a full host is when an operator most wants to look — is answered 200,
    well framed, with the exposition; the host serves afterwards."""
    rng = random.Random(800)
    identity = distinctive(rng, "I-")
    secrets = secret_pattern(identity)
    runner = Recorder()
    scrape = get("/metrics", [(ID, identity)])
    answers: list[Answer] = []
    problems: list[str] = []
    socks: list[trio.socket.SocketType] = []
    async with running_host(runner=runner, host_identity=identity, max_connections=SCRAPE_CAP) as (
        host,
        port,
    ):
        runner.host = host
        admission, stats = host.admission, host.services.stats

        async def connect() -> None:
            socks.append(await connected(port))

        async def read(sock: trio.socket.SocketType) -> None:
            raw = await send_and_read(sock, scrape)
            answer = parse_answer(raw)
            answers.append(answer)
            problems.extend(problems_with(answer, secrets, raw))

        try:
            with trio.fail_after(HANG_GUARD_S):
                async with trio.open_nursery() as nursery:
                    for _ in range(SCRAPES):
                        nursery.start_soon(connect)
                while (  # noqa: ASYNC110 (the host has no event for an accepted connection)
                    admission.served.slots.borrowed_tokens + admission.refused.slots.borrowed_tokens
                    < SCRAPES
                ):
                    await trio.sleep(0.005)
                served = admission.served.slots.borrowed_tokens
                over_the_cap = admission.refused.slots.borrowed_tokens
                one_more = parse_answer(await raw_exchange(port, scrape))
                async with trio.open_nursery() as nursery:
                    for sock in socks:
                        nursery.start_soon(read, sock)
        finally:
            for sock in socks:
                sock.close()
        dropped = stats.connections_refused["dropped"]
        await health_and_a_fresh_batch(port, identity, runner)
    assert served == SCRAPE_CAP and over_the_cap == SCRAPES - SCRAPE_CAP
    assert one_more.status == 0 and dropped == 1  # beyond the overflow: closed at once
    assert len(answers) == SCRAPES and not problems, problems[:5]
    assert collections.Counter(answer.status for answer in answers) == {200: SCRAPES}
    assert all(b"trio_gym_connections_open" in answer.body for answer in answers)


async def test_a_thousand_failure_classes_keep_the_metrics_bounded_and_every_record_whole() -> None:
    """A batch whose 1,000 examples each fail with a failure class of their own (900 shaped as
    names, 100 not): every failure record comes back with its own class, while /metrics counts
    them under at most MAX_FOREIGN_LABELS classes and ``other``, 1,000 in all."""
    rng = random.Random(1000)
    identity = distinctive(rng, "I-")
    classes = [f"class_{n:04d}" for n in range(900)] + [f"Not A Name {n}!" for n in range(100)]
    body = json.dumps({"examples": [{"class": c} for c in classes], "failures": "records"})
    async with running_host(runner=FailingRunner(), host_identity=identity) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            ran = parse_answer(await raw_exchange(port, post(body.encode(), [(ID, identity)])))
            scraped = parse_answer(await raw_exchange(port, get("/metrics", [(ID, identity)])))
    assert ran.status == 200 and scraped.status == 200
    assert [record[FAILURE_CLASS_KEY] for record in ran.json()["results"]] == classes
    samples = parse_metrics(scraped.body.decode())
    failed = {
        dict(labels)["failure_class"]: value
        for (name, labels), value in samples.items()
        if name == "trio_gym_examples_total" and dict(labels).get("outcome") == "failed"
    }
    assert OTHER in failed and len(failed) <= MAX_FOREIGN_LABELS + 1, sorted(failed)
    assert sum(failed.values()) == len(classes)
    assert failed[OTHER] == len(classes) - (len(failed) - 1)


# --- 4. abandoned keyed batches -----------------------------------------------------------------

ABANDONED: Final = 6000
ABANDON_MAX_BATCHES: Final = 16
ABANDON_GRACE_S: Final = 0.1
ABANDON_RETENTION_S: Final = 0.5


async def test_six_thousand_keyed_posts_half_abandoned_never_run_more_than_max_batches() -> None:
    """6,000 keyed POSTs, 128 at a time, against a host with room for 16 batches: half the
    callers close right after sending, half read their answer. At no moment do more than 16
    batches run (the host's count, sampled, and the runner's own view) — and 16 do; the readers
    get 200 or 503 host_busy; no key runs twice; the host's keyed tables hold what ran and no
    more, and let go of it after the retention; a key refused busy is free and runs later. Then
    16 batches given up by DELETE while they run: their readers are cut, not ended as if whole,
    and their keys are refused 410 ever after. The host serves afterwards."""
    rng = random.Random(6000)
    identity = distinctive(rng, "I-")
    runner = Recorder(pause_s=0.2)
    overrides: dict[str, Any] = {
        "host_identity": identity,
        "max_batches": ABANDON_MAX_BATCHES,
        "reattach_grace_s": ABANDON_GRACE_S,
        "answer_retention_s": ABANDON_RETENTION_S,
    }
    statuses: collections.Counter[int] = collections.Counter()
    refused_keys: list[str] = []
    problems: list[str] = []
    peaks = Peaks()

    def keyed(key: str, pause_s: float | None = None) -> bytes:
        return post(batch(f"ab:{key}", pause_s=pause_s), [(ID, identity), (KEY, key)])

    async with running_host(runner=runner, **overrides) as (host, port):
        runner.host = host
        stats, kept = host.services.stats, host.services.keyed

        async def caller(n: int, slots: trio.CapacityLimiter) -> None:
            key = f"abandoned-{n}"
            async with slots:
                sock = await connected(port)
                with sock:
                    if n % 2:
                        await send_all(sock, keyed(key))
                        return  # closed right after sending
                    answer = parse_answer(await send_and_read(sock, keyed(key)))
            statuses[answer.status] += 1
            if answer.status == 503:
                refused_keys.append(key)
                if answer.code != "host_busy" or answer.headers.get("retry-after") != "1":
                    problems.append(f"{key}: {answer}")

        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_peaks, host, peaks)
                async with trio.open_nursery() as callers:
                    slots = trio.CapacityLimiter(128)
                    for n in range(ABANDONED):
                        callers.start_soon(caller, n, slots)
                await stats.batch_changes.until(lambda: stats.batches_running == 0)
                nursery.cancel_scope.cancel()
        ran = {mark for mark in runner.marks if mark.startswith("ab:")}
        held = (len(kept._batches), len(kept._finished), len(kept.memory.ran))
        given_up = len(kept.memory.given_up)
        await trio.sleep(ABANDON_RETENTION_S + ABANDON_GRACE_S)
        with trio.fail_after(REQUEST_GUARD_S):  # a refused key is free: it runs now
            again = parse_answer(await raw_exchange(port, keyed(refused_keys[0])))
        after_retention = (len(kept._batches), len(kept._finished), len(kept.memory.ran))

        # As many batches given up while they run (a DELETE under each key, their callers
        # still reading): each is cut, remembered, and refused ever after.
        given_up_keys = [f"given-up-{n}" for n in range(ABANDON_MAX_BATCHES)]
        cut: list[Answer] = []
        deleted: list[Any] = []

        async def reading(key: str) -> None:
            cut.append(parse_answer(await raw_exchange(port, keyed(key, pause_s=3600))))

        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                for key in given_up_keys:
                    nursery.start_soon(reading, key)
                while len(runner.running) < ABANDON_MAX_BATCHES:  # noqa: ASYNC110
                    await trio.sleep(0.005)
                for key in given_up_keys:
                    delete = get("/rollouts/run", [(ID, identity), (KEY, key)], "DELETE")
                    deleted.append(parse_answer(await raw_exchange(port, delete)).json())
            await stats.batch_changes.until(lambda: stats.batches_running == 0)
            refused_again = [await status_of(port, keyed(key, 3600)) for key in given_up_keys]
        remembered_after = len(kept.memory.ran)
        await health_and_a_fresh_batch(port, identity, runner)
        running = stats.examples_running
    print(
        f"\nabandoned keyed batches: {len(ran)} of {ABANDONED} ran; readers' statuses "
        f"{dict(statuses)}; peak batches {peaks.batches_running} (runner {runner.peak_batches})"
    )
    assert not problems, problems[:3]
    assert set(statuses) == {200, 503} and sum(statuses.values()) == ABANDONED // 2
    assert peaks.batches_running == ABANDON_MAX_BATCHES  # reached, and never passed
    assert runner.peak_counted <= ABANDON_MAX_BATCHES
    assert runner.peak_batches <= ABANDON_MAX_BATCHES
    assert peaks.keyed_running <= ABANDON_MAX_BATCHES
    assert max(runner.marks[mark] for mark in ran) == 1  # no key ran twice
    batches, finished, remembered = held
    assert batches == finished and finished + remembered == len(ran) and given_up == 0
    assert again.status == 200 and runner.marks[f"ab:{refused_keys[0]}"] == 1
    assert after_retention == (1, 1, len(ran))  # only the answer just given is kept
    assert deleted == [{"key": key, "cancelled": True} for key in given_up_keys]
    assert [(answer.status, answer.framed) for answer in cut] == [(200, False)] * len(cut)
    assert refused_again == [410] * len(given_up_keys)
    assert all(runner.marks[f"ab:{key}"] == 1 for key in given_up_keys)
    assert remembered_after == len(ran) + len(given_up_keys)
    assert running == 0


HANG_UP_GUARD_S: Final = 10
"""Fifty times the grace: the batch has been given up long before, unless nothing noticed."""


@pytest.mark.parametrize("how", ["close", "reset", "reset-http-1.0"])
async def test_a_keyed_batch_whose_caller_hangs_up_is_given_up_once_the_grace_has_passed(
    how: str,
) -> None:
    """A keyed batch runs on for reattach_grace_s after its caller hung up, and is then given
    up (README, max_batches) — not only once a heartbeat, an interval later, finds the socket
    dead: with heartbeats an hour apart, its example is cancelled all the same. Over HTTP/1.0
    (no byte before the answer's end) a reset is noticed too."""
    rng = random.Random(61)
    identity = distinctive(rng, "I-")
    runner = Recorder(pause_s=3600)
    async with running_host(
        runner=runner, host_identity=identity, reattach_grace_s=0.2, heartbeat_interval_s=3600
    ) as (host, port):
        stats = host.services.stats
        sock = await connected(port)
        with sock:
            version = "1.0" if how == "reset-http-1.0" else "1.1"
            headers = [(ID, identity), (KEY, "hung-up")]
            await send_all(sock, post(batch("held"), headers, version=version))
            with trio.fail_after(REQUEST_GUARD_S):
                while not runner.running:  # noqa: ASYNC110 (the runner's start is the event)
                    await trio.sleep(0.005)
            if how.startswith("reset"):  # SO_LINGER 0: close sends RST, as a killed trainer's does
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:  # read the answer's head first: with nothing unread, close sends FIN
                head = b""
                with trio.fail_after(REQUEST_GUARD_S):
                    while b"\r\n\r\n" not in head and (chunk := await sock.recv(65536)):
                        head += chunk
        with trio.fail_after(HANG_UP_GUARD_S):  # an hour's heartbeat never comes
            await stats.batch_changes.until(lambda: stats.batches_running == 0)
        assert stats.examples_cancelled == 1 and not runner.running


# --- 5. identity, token and key probes ----------------------------------------------------------


def every_route(token: str) -> list[tuple[str, bytes]]:
    """One request for each route (an unknown path too), each carrying the right token and a
    body that would do something if it were let through: a marked batch, a checkpoint prepare."""
    auth = ("Authorization", f"Bearer {token}")
    call = json.dumps({"checkpoint_id": "probe", "deadline": FAR_FUTURE}).encode()
    return [
        ("GET /health", get("/health", [auth])),
        ("GET /metrics", get("/metrics", [auth])),
        ("POST /rollouts/run", post(batch("probe"), [auth])),
        ("POST /rollouts/run keyed", post(batch("probe"), [auth, (KEY, "probe-1")])),
        ("DELETE /rollouts/run", get("/rollouts/run", [auth, (KEY, "probe-2")], "DELETE")),
        ("OPTIONS *", get("*", [auth], "OPTIONS")),
        ("GET /nowhere", get("/nowhere", [auth])),
        ("GET status", get(f"{CONTROL}status", [auth])),
        ("POST prepare", post(call, [auth], target=f"{CONTROL}prepare")),
        ("POST resume", post(call, [auth], target=f"{CONTROL}resume")),
    ]


def identity_probes(identity: str) -> list[tuple[str, list[bytes], int, str]]:
    """(name, the identity header values sent, the status every route but /health gets, what
    the refusal names): none at all, malformed lines, and every near miss."""
    i = identity.encode()
    return [
        ("none", [], 403, "identity_required"),
        ("empty", [b""], 403, "identity_required"),
        ("cr", [i[:9] + b"\r" + i[9:]], 400, ID),
        ("cr-at-the-end", [i + b"\r"], 400, ID),
        ("nul", [i[:9] + b"\x00" + i[9:]], 400, ID),
        ("vertical-tab", [i[:9] + b"\x0b" + i[9:]], 400, ID),
        ("lf", [i[:9] + b"\n" + i[9:]], 400, "no ':'"),
        ("del", [i + b"\x7f"], 421, "wrong_host"),
        ("escape", [i[:9] + b"\x1b" + i[9:]], 421, "wrong_host"),
        ("latin-1", [i + b"\xe9"], 421, "wrong_host"),
        ("utf-8", [i[:9] + "é".encode() + i[9:]], 421, "wrong_host"),
        ("prefix", [i[:-1]], 421, "wrong_host"),
        ("first-eight", [i[:8]], 421, "wrong_host"),
        ("suffix", [i + b"x"], 421, "wrong_host"),
        ("without-its-first", [i[1:]], 421, "wrong_host"),
        ("case-changed", [i.swapcase()], 421, "wrong_host"),
        ("upper-case", [i.upper()], 421, "wrong_host"),
        ("inner-space", [i[:9] + b" " + i[9:]], 421, "wrong_host"),
        ("doubled", [i + i], 421, "wrong_host"),
        ("overlong", [i + b"a" * 12_000], 421, "wrong_host"),
        ("over-the-head-limit", [i * (MAX_HEAD_BYTES // len(i) + 1)], 431, "headers_too_large"),
        ("right-then-wrong", [i, i + b"x"], 421, "wrong_host"),
        ("wrong-then-right", [i[:-1], i], 421, "wrong_host"),
    ]


def token_probes(token: str) -> list[tuple[str, bytes | None, int, str]]:
    """(name, the Authorization value sent, the status a control route gets, what the refusal
    names)."""
    t = token.encode()
    return [
        ("none", None, 401, "unauthorized"),
        ("empty", b"", 401, "unauthorized"),
        ("prefix", b"Bearer " + t[:-1], 401, "unauthorized"),
        ("first-eight", b"Bearer " + t[:8], 401, "unauthorized"),
        ("suffix", b"Bearer " + t + b"x", 401, "unauthorized"),
        ("case-changed", b"Bearer " + t.swapcase(), 401, "unauthorized"),
        ("basic", b"Basic " + t, 401, "unauthorized"),
        ("no-scheme", t, 401, "unauthorized"),
        ("no-space", b"Bearer" + t, 401, "unauthorized"),
        ("latin-1", b"Bearer " + t + b"\xe9", 401, "unauthorized"),
        ("del", b"Bearer " + t + b"\x7f", 401, "unauthorized"),
        ("overlong", b"Bearer " + t * 300, 401, "unauthorized"),
        ("cr", b"Bearer " + t[:9] + b"\r" + t[9:], 400, "authorization"),
        ("nul", b"Bearer " + t[:9] + b"\x00" + t[9:], 400, "authorization"),
        ("lf", b"Bearer " + t[:9] + b"\n" + t[9:], 400, "no ':'"),
        ("over-the-head-limit", b"Bearer " + t * (MAX_HEAD_BYTES // len(t) + 1), 431, ""),
    ]


def with_identities(request: bytes, values: Sequence[bytes]) -> bytes:
    for value in values:
        request = with_header(request, ID.encode(), value)
    return request


def without_header(request: bytes, name: bytes) -> bytes:
    head, _, body = request.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(name + b":")]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def test_bad_identities_and_tokens_are_refused_on_every_route_and_run_nothing() -> None:
    """On every route: no identity is 403 (but /health, which says ready and nothing more), a
    malformed identity line is 400 naming the header (an LF makes a line with no ':', said so),
    any other value — a prefix, a suffix, a case changed, a byte beyond ASCII, a second value —
    is 421, one past the head limit 431. With the identity, on every control route, a missing or
    wrong bearer token is 401 and a malformed Authorization line 400 naming the header; a
    malformed one is 400 on every other route too. No refusal quotes a piece of the identity or
    the token, none is large, each is well framed; nothing runs, no checkpoint starts, no key is
    remembered."""
    rng = random.Random(5)
    identity, token = distinctive(rng, "I-"), distinctive(rng, "T-")
    secrets = secret_pattern(identity, token)
    runner = Recorder()
    wrong: list[str] = []
    probed = 0

    def check(name: str, raw: bytes, status: int, names: str, document: Any = None) -> None:
        nonlocal probed
        probed += 1
        answer = parse_answer(raw)
        problems = problems_with(answer, secrets, raw)
        if answer.status != status:
            problems.append(f"status {answer.status}, not {status}")
        said = f"{answer.code} {answer.message}".lower()
        if names and names.lower() not in said:
            problems.append(f"does not name {names!r}: {said!r}")
        if document is not None and answer.status == status and answer.json() != document:
            problems.append(f"says {answer.body!r}")
        if problems:
            wrong.append(f"{name}: {problems}")

    async with running_host(runner=runner, host_identity=identity, control_token=token) as (
        host,
        port,
    ):
        with trio.fail_after(HANG_GUARD_S):
            for route, request in every_route(token):
                for probe, values, status, names in identity_probes(identity):
                    raw = await raw_exchange(port, with_identities(request, values))
                    if route == "GET /health" and status in (403, 421):
                        stranger = status == 403
                        document = {"status": "ready"} if stranger else None
                        check(f"{route} {probe}", raw, 200 if stranger else 421, "", document)
                    else:
                        check(f"{route} {probe}", raw, status, names)
                me = with_identities(without_header(request, b"authorization"), [identity.encode()])
                control = route.startswith(("GET status", "POST prepare", "POST resume"))
                for probe, value, status, names in token_probes(token):
                    sent = me if value is None else with_header(me, b"Authorization", value)
                    # A control route checks the token; a malformed line is refused on any.
                    if control or status in (400, 431):
                        raw = await raw_exchange(port, sent)
                        check(f"{route} token {probe}", raw, status, names)
        phase = host.services.checkpoints.phases.phase
        kept = host.services.keyed
        remembered = (len(kept._batches), len(kept.memory.ran), len(kept.memory.given_up))
    assert probed > 300
    assert not wrong, wrong[:10]
    assert not runner.marks  # nothing ran
    assert phase is CheckpointPhase.IDLE and remembered == (0, 0, 0)


async def test_keys_outside_the_alphabet_are_refused_naming_the_rule_and_run_nothing() -> None:
    """An Idempotency-Key must be 1 to 255 bytes of 0x21-0x7E: one with a space, a byte beyond
    ASCII, a control byte h11 lets through, 256 bytes, nothing, or given twice is 400 naming the
    rule and never the key, on POST and DELETE alike; a CR or NUL is h11's 400 naming the header.
    Nothing of them runs or is remembered; the widest legal keys (255 bytes, every allowed byte)
    run."""
    rng = random.Random(255)
    identity = distinctive(rng, "I-")
    secret = distinctive(rng, "key-")
    secrets = secret_pattern(identity, secret)
    k = secret.encode()
    runner = Recorder()
    rule = "Idempotency-Key must be 1 to 255"
    bad: list[tuple[str, list[bytes], str]] = [
        ("space", [k[:9] + b" " + k[9:]], rule),
        ("latin-1", [k + b"\xe9"], rule),
        ("utf-8", [k + "é".encode()], rule),
        ("del", [k + b"\x7f"], rule),
        ("escape", [k[:9] + b"\x1b" + k[9:]], rule),
        ("tab", [k[:9] + b"\t" + k[9:]], rule),
        ("256-bytes", [(k * 10)[:256]], rule),
        ("empty", [b""], rule),
        ("twice", [k, k], "given 2 times"),
        ("cr", [k[:9] + b"\r" + k[9:]], "idempotency-key"),
        ("nul", [k[:9] + b"\x00" + k[9:]], "idempotency-key"),
    ]
    wrong: list[str] = []
    good = [(k * 10)[:255], bytes(range(0x21, 0x7F))]
    async with running_host(runner=runner, host_identity=identity) as (host, port):
        with trio.fail_after(HANG_GUARD_S):
            for how, values, names in bad:
                for method in ("POST", "DELETE"):
                    request = post(batch("bad-key"), [(ID, identity)])
                    if method == "DELETE":
                        request = get("/rollouts/run", [(ID, identity)], "DELETE")
                    for value in values:
                        request = with_header(request, KEY.encode(), value)
                    raw = await raw_exchange(port, request)
                    answer = parse_answer(raw)
                    problems = problems_with(answer, secrets, raw)
                    if answer.status != 400 or names.lower() not in answer.message.lower():
                        problems.append(f"{answer.status} {answer.message!r}")
                    if problems:
                        wrong.append(f"{method} {how}: {problems}")
            answers = []
            for n, key in enumerate(good):
                request = with_header(post(batch(f"good-{n}"), [(ID, identity)]), KEY.encode(), key)
                answers.append(parse_answer(await raw_exchange(port, request)))
        kept = host.services.keyed
        remembered = len(kept._batches) + len(kept.memory.ran) + len(kept.memory.given_up)
    assert not wrong, wrong
    assert [answer.status for answer in answers] == [200, 200]
    assert dict(runner.marks) == {"good-0": 1, "good-1": 1}
    assert remembered == 2  # the two good keys' answers, kept


GIVEN_UP_CAPACITY: Final = 64


async def test_deletes_of_unseen_keys_are_remembered_and_a_full_table_refuses_not_forgets() -> None:
    """A DELETE under a key no POST has used yet is remembered, so a POST under it still on its
    way is refused 410 and never runs: 64 of them, sent at once, against a table of 64; the 65th
    DELETE is refused 503 host_busy (with Retry-After) rather than pushing one out, and its key,
    not remembered, runs when it comes. No answer leaks the identity, and the host serves
    afterwards."""
    rng = random.Random(64)
    identity = distinctive(rng, "I-")
    secrets = secret_pattern(identity)
    runner = Recorder()
    keys = [f"unseen-{n}" for n in range(GIVEN_UP_CAPACITY + 1)]
    deleted: dict[str, Answer] = {}

    async with running_host(runner=runner, host_identity=identity, answer_retention_s=600) as (
        host,
        port,
    ):
        kept = host.services.keyed
        kept.memory = KeyMemory(lifetime_s=600, given_up_capacity=GIVEN_UP_CAPACITY)

        async def delete(key: str) -> None:
            request = get("/rollouts/run", [(ID, identity), (KEY, key)], "DELETE")
            deleted[key] = parse_answer(await raw_exchange(port, request))

        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                for key in keys[:-1]:
                    nursery.start_soon(delete, key)
            await delete(keys[-1])
            posted = [
                parse_answer(
                    await raw_exchange(port, post(batch(key), [(ID, identity), (KEY, key)]))
                )
                for key in keys
            ]
        remembered = len(kept.memory.given_up)
        await health_and_a_fresh_batch(port, identity, runner)
    for key in keys[:-1]:
        assert deleted[key].json() == {"key": key, "cancelled": False}
    full = deleted[keys[-1]]
    assert full.status == 503 and full.code == "host_busy" and "retry-after" in full.headers
    assert [answer.status for answer in posted] == [410] * GIVEN_UP_CAPACITY + [200]
    assert all(answer.code == "answer_expired" for answer in posted[:-1])
    assert dict(runner.marks) == {keys[-1]: 1, "fresh": 1}  # only the key not remembered ran
    assert remembered == GIVEN_UP_CAPACITY
    for answer in [*deleted.values(), *posted]:
        assert not problems_with(answer, secrets, answer.body)
