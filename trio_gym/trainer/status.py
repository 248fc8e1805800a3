"""``trio-gym status URL...``: what each host is doing, one line per host, read from its
``/health`` and ``/metrics``. On a terminal the view refreshes in place until Ctrl-C; otherwise
(a pipe, a file, ``--once``) it is printed once, from two reads ``interval`` apart so that its
rates are measured, not guessed."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Final, TextIO

import attrs
import trio

from trio_gym.errors import DEFAULT_STATUS, ErrorCode
from trio_gym.exposition import EXTRA_ADVICE, PREFIX, MetricsUnavailable
from trio_gym.http import BodyFailed, Endpoint, HttpLimits, NoResponse, exchange
from trio_gym.protocol.rollouts import METRICS_PATH
from trio_gym.trainer.hosts import Health, HealthStatus, HostHandle, probe

MAX_METRICS_BYTES: Final = 4 * 1024 * 1024
COLUMNS: Final = ("HOST", "HEALTH", "STAGE", "BATCHES", "EXAMPLES", "EX/S", "BEAT LATE", "FAILED")
# Clear the screen and go home: each frame is drawn whole, so a shorter one leaves nothing.
CLEAR: Final = "\x1b[H\x1b[2J"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@attrs.frozen
class Reading:
    """One read of one host: its health, and its metrics (``None`` when they could not be read,
    ``why`` says so)."""

    url: str
    at: float
    health: Health
    samples: Samples | None
    why: str = ""

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(
            value
            for (sample, sample_labels), value in (self.samples or {}).items()
            if sample == name and wanted <= sample_labels
        )

    def labelled(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples by the value of ``label``."""
        found: dict[str, float] = {}
        for (sample, labels), value in (self.samples or {}).items():
            if sample == name:
                key = dict(labels).get(label, "")
                found[key] = found.get(key, 0.0) + value
        return found


def parse_metrics(text: str) -> Samples:
    """Every sample of an exposition, by name and labels (Prometheus's own parser)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:
        raise MetricsUnavailable(
            f"reading /metrics needs prometheus_client: {EXTRA_ADVICE}"
        ) from exc
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def read_host(handle: HostHandle, *, timeout_s: float) -> Reading:
    """``/health`` and ``/metrics`` of the host ``handle`` names, each within ``timeout_s``, as
    the holder of its identity (a host launched with one tells anyone else only whether it is
    ready). Raises :class:`MetricsUnavailable` without ``prometheus_client``."""
    url = handle.url
    health = await probe(handle, timeout_s=timeout_s)
    at = trio.current_time()
    why = ""
    samples: Samples | None = None
    with trio.move_on_after(timeout_s) as waited:
        try:
            response = await exchange(
                Endpoint.parse(url),
                "GET",
                METRICS_PATH,
                limits=HttpLimits(),
                max_response_bytes=MAX_METRICS_BYTES,
                idle_timeout_s=timeout_s,
                headers=handle.request_headers(),
            )
        except (NoResponse, BodyFailed) as exc:
            why = str(exc)
        else:
            if response.status == 200:
                try:
                    samples = parse_metrics(response.body.decode())
                except ValueError as exc:
                    why = f"/metrics is not Prometheus text: {exc}"
            elif response.status == DEFAULT_STATUS[ErrorCode.IDENTITY_REQUIRED]:
                why = "it answers only the holder of its identity: give --identity-file"
            elif response.status == DEFAULT_STATUS[ErrorCode.WRONG_HOST]:
                why = "the identity given is not the one this host was launched with"
            else:
                why = f"/metrics answered HTTP {response.status}"
    if waited.cancelled_caught:
        why = f"no answer to GET /metrics within {timeout_s:g} s"
    return Reading(url, at, health, samples, why)


def line_of(now: Reading, before: Reading | None) -> dict[str, str]:
    """The columns of one host, from this read and (for rates) the one before."""
    line = {"HOST": now.url, "HEALTH": _health(now.health)}
    if now.samples is None:
        return line | {"STAGE": now.why or "-"}
    stages = [stage for stage, value in now.labelled(f"{PREFIX}stage", "stage").items() if value]
    line["STAGE"] = stages[0] if stages else "-"
    line["BATCHES"] = f"{now.total(f'{PREFIX}batches_in_flight'):.0f}"
    line["EXAMPLES"] = f"{now.total(f'{PREFIX}examples_in_flight'):.0f}"
    line["EX/S"] = _rate(now, before)
    line["BEAT LATE"] = _lateness(now, before)
    failed = {
        dict(labels).get("failure_class", ""): count
        for (name, labels), count in now.samples.items()
        if name == f"{PREFIX}examples_total" and ("outcome", "failed") in labels and count
    }
    line["FAILED"] = (
        ", ".join(f"{cls or 'unclassed'} {n:.0f}" for cls, n in sorted(failed.items())) or "none"
    )
    return line


def _health(health: Health) -> str:
    if health.status is HealthStatus.READY:
        return "ready"
    return health.status.value


def _rate(now: Reading, before: Reading | None) -> str:
    if before is None or before.samples is None or now.at <= before.at:
        return "-"
    ended = now.total(f"{PREFIX}examples_total") - before.total(f"{PREFIX}examples_total")
    return f"{max(0.0, ended) / (now.at - before.at):.1f}"


def _lateness(now: Reading, before: Reading | None) -> str:
    """The 99th percentile of the heartbeats written since the read before (all of them when
    there is none), as the bucket bound it falls under."""
    name = f"{PREFIX}heartbeat_lateness_seconds_bucket"
    buckets = now.labelled(name, "le")
    if before is not None and before.samples is not None:
        earlier = before.labelled(name, "le")
        buckets = {le: count - earlier.get(le, 0.0) for le, count in buckets.items()}
    ordered = sorted(buckets.items(), key=lambda item: float(item[0]))
    total = ordered[-1][1] if ordered else 0.0
    if total <= 0:
        return "-"
    for le, count in ordered:
        if count >= 0.99 * total:
            bound = float(le)
            return "over 10 s" if math.isinf(bound) else f"p99 ≤ {_seconds(bound)}"
    return "-"


def _seconds(value: float) -> str:
    return f"{value * 1000:g} ms" if value < 1 else f"{value:g} s"


def table(lines: Sequence[Mapping[str, str]]) -> str:
    """A table: a column per field, as wide as its widest cell."""
    rows = [list(COLUMNS), *([line.get(column, "-") for column in COLUMNS] for line in lines)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


async def read_all(hosts: Sequence[HostHandle], timeout_s: float) -> list[Reading]:
    readings: list[Reading | None] = [None] * len(hosts)

    async def read(index: int) -> None:
        readings[index] = await read_host(hosts[index], timeout_s=timeout_s)

    async with trio.open_nursery() as nursery:
        for index in range(len(hosts)):
            nursery.start_soon(read, index)
    return [reading for reading in readings if reading is not None]


async def show_status(
    urls: Sequence[str],
    *,
    interval_s: float,
    live: bool,
    out: TextIO = sys.stdout,
    timeout_s: float = 5.0,
    identity: str = "",
) -> int:
    """Print the view (see the module docstring) of the hosts at ``urls``, presenting
    ``identity`` to them; 0 when every host is ready, 1 otherwise (live, it runs until
    cancelled). Raises :class:`MetricsUnavailable` at once without ``prometheus_client``."""
    parse_metrics("")  # not after the first reads: a missing library is said before anything
    hosts = [HostHandle(url, url, identity=identity) for url in urls]
    before = await read_all(hosts, timeout_s)
    if not live:
        await trio.sleep(interval_s)
        now = await read_all(hosts, timeout_s)
        out.write(table([line_of(n, b) for n, b in zip(now, before, strict=True)]) + "\n")
        out.flush()
        return 0 if all(r.health.status is HealthStatus.READY for r in now) else 1
    previous: Sequence[Reading | None] = [None] * len(urls)
    now = before
    while True:
        shown = table([line_of(n, b) for n, b in zip(now, previous, strict=True)])
        out.write(
            f"{CLEAR}trio-gym status: {len(urls)} host(s), every {interval_s:g} s "
            f"(Ctrl-C to quit)\n\n{shown}\n"
        )
        out.flush()
        await trio.sleep(interval_s)
        previous, now = now, await read_all(hosts, timeout_s)
