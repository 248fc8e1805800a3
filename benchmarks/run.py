"""The host measured side by side with its peers, in one run (see BENCHMARKS.md).

    python -m benchmarks.run                      # everything, 3 runs, medians
    python -m benchmarks.run --quick              # a smaller version, to try it out
    python -m benchmarks.run --only held --sizes 10000 --runs 1

Each workload starts a fresh server process pinned to CPU 0 (``taskset``); load generators run
pinned to CPU 1. Servers: ``trio_gym`` (this project), ``threaded`` (the stdlib design it
replaces) and ``uvicorn`` (uvloop + httptools); with h11-mypyc installed, ``trio_gym`` speaks it
and ``trio_gym_h11`` is the same host on pure h11; ``trio_gym_scraped`` is the host with
``benchmarks/scraper.py`` reading its ``/metrics`` every second meanwhile (on CPU 1, beside the
load). Every figure is a median over the runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("trio_gym", "trio_gym_scraped", "trio_gym_h11", "threaded", "uvicorn")
# trio_gym_h11: the same host kept on pure h11 while h11-mypyc (the ``fast`` extra) is installed,
# so the accelerator's effect is a ratio within one run.
PURE_H11 = (
    "import runpy, sys; sys.modules['h11_mypyc'] = None; "
    "runpy.run_module('trio_gym', run_name='__main__', alter_sys=True)"
)
# trio_gym_scraped: the same host with a scraper reading /metrics every SCRAPE_S (issue 26: what
# being watched costs, as a ratio within one run).
SCRAPE_S = 1.0
# The stack's floor (benchmarks/peers/floor.py): measured on short batches only.
FLOORS = ("floor_bare", "floor_h11", "floor_tasks")
HEARTBEAT_S = 1.0
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_status(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` size field, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Server:
    def __init__(self, kind: str, events: Path, log: Path) -> None:
        self.kind, self.port = kind, free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_EVENTS": str(events)}
        if kind in ("trio_gym", "trio_gym_h11", "trio_gym_scraped"):
            env.update(
                NMP_RUNNER="benchmarks.workload:think_runner",
                NMP_RUNTIME_HTTP_PORT=str(self.port),
                NMP_HEARTBEAT_INTERVAL_S=str(HEARTBEAT_S),
                NMP_MAX_CONNECTIONS="20000",
                NMP_MAX_BATCHES="20000",
                NMP_MAX_RESPONSE_BYTES=str(1 << 30),
            )
            command = [sys.executable, "-m", "trio_gym", "serve"]
            if kind == "trio_gym_h11":
                command = [sys.executable, "-c", PURE_H11, "serve"]
        elif kind in FLOORS:
            command = [sys.executable, "-m", "benchmarks.peers.floor", str(self.port)]
            command += ["--variant", kind.removeprefix("floor_"), "--heartbeat-s", str(HEARTBEAT_S)]
        else:
            module = {"threaded": "benchmarks.peers.threaded", "uvicorn": "benchmarks.peers.asgi"}
            command = [sys.executable, "-m", module[kind], str(self.port)]
            command += ["--heartbeat-s", str(HEARTBEAT_S)]
        self.log = log.open("ab")
        self.process = subprocess.Popen(
            ["taskset", "-c", "0", *command], env=env, stdout=self.log, stderr=self.log, cwd=ROOT
        )
        self.pid = self.process.pid
        self._wait_ready()

    def _wait_ready(self) -> None:
        for _ in range(300):
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port)) as s,
            ):
                s.sendall(b"GET /health HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
                if s.recv(100).startswith(b"HTTP/1.1 200"):
                    return
            time.sleep(0.1)
        raise SystemExit(f"{self.kind} did not become ready on port {self.port}")

    def rss(self) -> int:
        return proc_status(self.pid, "VmRSS")

    def peak_rss(self) -> int:
        return proc_status(self.pid, "VmHWM")

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def close(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.log.close()


@contextlib.contextmanager
def server(kind: str, scratch: Path) -> Iterator[tuple[Server, Path]]:
    events = scratch / f"{kind}-{time.monotonic_ns()}.events"
    events.touch()
    running = Server(kind, events, scratch / f"{kind}.log")
    scraper = None
    if kind == "trio_gym_scraped":
        scrape = ["benchmarks.scraper", str(running.port), str(SCRAPE_S)]
        scraper = subprocess.Popen(
            ["taskset", "-c", "1", sys.executable, "-m", *scrape],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        yield running, events
    finally:
        if scraper is not None:
            scraper.send_signal(signal.SIGTERM)
            said, _ = scraper.communicate()
            counts = json.loads(said)
            print(f"scraper: {said.strip()}", flush=True)
            if counts["failed"] or not counts["scrapes"]:
                raise SystemExit(f"the scraper of {kind} failed: {counts}")
        running.close()


def generator(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["taskset", "-c", "1", sys.executable, "-m", "benchmarks.load", *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def read_line(process: subprocess.Popen[str], key: str) -> Any:
    assert process.stdout is not None
    for line in process.stdout:
        message = json.loads(line)
        if key in message:
            return message[key]
    raise SystemExit(f"load generator exited ({process.wait()}) before reporting {key!r}")


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def warm(port: int) -> None:
    read_line(generator("probe", str(port), "5"), "figures")


# --- the workloads ------------------------------------------------------------------------


def held(kind: str, count: int, scratch: Path) -> dict[str, Any]:
    think_s = 10.0 + count / 500
    with server(kind, scratch) as (host, _):
        warm(host.port)
        baseline, cpu0 = host.rss(), host.cpu()
        shares = max(1, count // 2500)
        loads = [
            generator(
                "hold",
                str(host.port),
                str(count // shares),
                str(think_s),
                "--heartbeat-s",
                str(HEARTBEAT_S),
                "--first-n",
                str(i * (count // shares)),
            )
            for i in range(shares)
        ]
        started = time.monotonic()
        holding = sum(read_line(load, "held") for load in loads)
        ramp_s = time.monotonic() - started
        time.sleep(2 * HEARTBEAT_S)
        rss_held = host.rss()
        figures = [read_line(load, "figures") for load in loads]
        cpu = host.cpu() - cpu0
        peak = host.peak_rss()
    arrivals = sorted(tuple(x) for f in figures for x in f["lateness"])
    lateness = [late for _, late in arrivals]
    # The steady state: heartbeats after every connection was held (the ramp excluded).
    ramped = arrivals[0][0] + ramp_s if arrivals else 0.0
    steady = [late for at, late in arrivals if at >= ramped]
    return {
        "count": count,
        "holding": holding,
        "correct": sum(f["correct"] for f in figures),
        "errors": sorted({e for f in figures for e in f["errors"]})[:3],
        "peak_rss_mib": peak / 2**20,
        "rss_per_connection_kib": (rss_held - baseline) / count / 1024,
        "lateness_p50_ms": 1000 * percentile(lateness, 50),
        "lateness_p99_ms": 1000 * percentile(lateness, 99),
        "heartbeats": len(lateness),
        "ramp_s": ramp_s,
        "steady_lateness_p99_ms": 1000 * percentile(steady, 99),
        # The whole distribution, for the figure: the lateness at each percent, 0 to 100.
        "lateness_percentiles_ms": [1000 * percentile(lateness, p) for p in range(101)],
        "cpu_s": cpu,
    }


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{"examples": [{"n": 1, "think_s": 0}]}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Connection"] = "close"
"""


def short(kind: str, seconds: int, scratch: Path) -> dict[str, Any]:
    script = scratch / "post.lua"
    script.write_text(WRK_SCRIPT)
    with server(kind, scratch) as (host, _):
        warm(host.port)
        out = subprocess.run(
            [
                "taskset",
                "-c",
                "1",
                "wrk",
                "-t1",
                "-c64",
                f"-d{seconds}s",
                "--latency",
                "-s",
                str(script),
                f"http://127.0.0.1:{host.port}/rollouts/run",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def latency(label: str) -> float:
        match = re.search(rf"^\s+{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert match, out
        return float(match[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[match[2]]

    errors = re.search(r"Socket errors: (.*)", out)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "requests_per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1]),  # type: ignore[index]
        "latency_p50_ms": latency("50"),
        "latency_p99_ms": latency("99"),
        "socket_errors": errors[1] if errors else "",
        "non_2xx": int(non_2xx[1]) if non_2xx else 0,
    }


def ttfb(kind: str, scratch: Path) -> dict[str, Any]:
    with server(kind, scratch) as (host, _):
        warm(host.port)
        holding = generator("hold", str(host.port), "1000", "600", "--first-n", "1000000")
        read_line(holding, "held")
        samples = read_line(generator("probe", str(host.port), "200"), "figures")["ttfb"]
        holding.kill()
        holding.wait()
    return {
        "ttfb_p50_ms": 1000 * percentile(samples, 50),
        "ttfb_p99_ms": 1000 * percentile(samples, 99),
    }


def stop(kind: str, count: int, scratch: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with server(kind, scratch) as (host, events):
        warm(host.port)
        for how in ("reset", "close", "deadline"):
            left = read_line(generator("stop", str(host.port), str(count), how), "figures")["left"]
            cancelled = dict(line.split() for line in events.read_text().splitlines())
            delays = [float(cancelled[tag]) - at for tag, at in left.items() if tag in cancelled]
            figures[f"{how}_median_ms"] = 1000 * statistics.median(delays) if delays else None
            figures[f"{how}_never"] = len(left) - len(delays)
    return figures


def large(kind: str, scratch: Path, examples: int = 200, blob: int = 1 << 20) -> dict[str, Any]:
    with server(kind, scratch) as (host, _):
        warm(host.port)
        baseline = host.rss()
        figures = read_line(generator("large", str(host.port), str(examples), str(blob)), "figures")
        peak = host.peak_rss()
    size = figures["document_bytes"]
    return {
        "document_mib": size / 2**20,
        "correct": figures["correct"],
        "peak_rss_mib": peak / 2**20,
        "peak_over_document": peak / size,
        "growth_over_document": (peak - baseline) / size,
        "mib_per_s": size / 2**20 / figures["seconds"],
    }


# --- the run ------------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [run[key] for run in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[key] = statistics.median(values)
        elif all(isinstance(v, list) and v and isinstance(v[0], float) for v in values):
            merged[key] = [statistics.median(column) for column in zip(*values, strict=True)]
        elif all(v is None or isinstance(v, (int, float)) for v in values):
            present = [v for v in values if v is not None]
            merged[key] = statistics.median(present) if present else None
        else:
            merged[key] = values[-1] if not isinstance(value, bool) else all(values)
    return merged


ROWS: list[tuple[str, str, str, str]] = [
    # (workload, figure, label, format)
    ("held-100", "correct", "held 100: completed correctly", "{:.0f}"),
    ("held-100", "rss_per_connection_kib", "held 100: RSS per connection (KiB)", "{:.1f}"),
    ("held-100", "lateness_p99_ms", "held 100: heartbeat lateness p99 (ms)", "{:.1f}"),
    ("held-1000", "correct", "held 1,000: completed correctly", "{:.0f}"),
    ("held-1000", "rss_per_connection_kib", "held 1,000: RSS per connection (KiB)", "{:.1f}"),
    ("held-1000", "peak_rss_mib", "held 1,000: peak RSS (MiB)", "{:.0f}"),
    ("held-1000", "lateness_p50_ms", "held 1,000: heartbeat lateness p50 (ms)", "{:.1f}"),
    ("held-1000", "lateness_p99_ms", "held 1,000: heartbeat lateness p99 (ms)", "{:.1f}"),
    ("held-1000", "cpu_s", "held 1,000: host CPU (s)", "{:.1f}"),
    ("held-10000", "correct", "held 10,000: completed correctly", "{:.0f}"),
    ("held-10000", "ramp_s", "held 10,000: time until all held (s)", "{:.1f}"),
    ("held-10000", "rss_per_connection_kib", "held 10,000: RSS per connection (KiB)", "{:.1f}"),
    ("held-10000", "peak_rss_mib", "held 10,000: peak RSS (MiB)", "{:.0f}"),
    ("held-10000", "lateness_p50_ms", "held 10,000: heartbeat lateness p50 (ms)", "{:.1f}"),
    ("held-10000", "lateness_p99_ms", "held 10,000: heartbeat lateness p99 (ms)", "{:.1f}"),
    (
        "held-10000",
        "steady_lateness_p99_ms",
        "held 10,000: lateness p99 once all held (ms)",
        "{:.1f}",
    ),
    ("held-10000", "cpu_s", "held 10,000: host CPU (s)", "{:.1f}"),
    ("short", "requests_per_s", "short batches: requests/s (one core)", "{:.0f}"),
    ("short", "latency_p50_ms", "short batches: latency p50 (ms)", "{:.1f}"),
    ("short", "latency_p99_ms", "short batches: latency p99 (ms)", "{:.1f}"),
    ("ttfb-1000", "ttfb_p50_ms", "first byte with 1,000 held: p50 (ms)", "{:.2f}"),
    ("ttfb-1000", "ttfb_p99_ms", "first byte with 1,000 held: p99 (ms)", "{:.2f}"),
    ("stop", "reset_median_ms", "stop after a reset: median (ms)", "{:.1f}"),
    ("stop", "close_median_ms", "stop after a clean close: median (ms)", "{:.1f}"),
    ("stop", "deadline_median_ms", "stop after the deadline: median (ms)", "{:.1f}"),
    ("large", "peak_over_document", "200 MiB answer: peak RSS / document", "{:.2f}"),
    ("large", "growth_over_document", "200 MiB answer: RSS growth / document", "{:.2f}"),
    ("large", "mib_per_s", "200 MiB answer: MiB/s", "{:.0f}"),
]


def table(results: Path) -> str:
    """The medians of a results file as a markdown table, one column per server."""
    medians = json.loads(results.read_text())["medians"]
    servers = [kind for kind in SERVERS if any(kind in by for by in medians.values())]
    lines = ["| figure | " + " | ".join(servers) + " |", "|---|" + "---|" * len(servers)]
    for workload, figure, label, form in ROWS:
        if workload not in medians:
            continue
        cells = []
        for kind in servers:
            value = medians[workload].get(kind, {}).get(figure)
            cells.append("—" if value is None else form.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_table(results: Path) -> str:
    """Short batches' requests per second of every server and of the stack's floor."""
    short_medians = json.loads(results.read_text())["medians"].get("short", {})
    lines = ["| server | requests/s (one core) | latency p50 (ms) |", "|---|---|---|"]
    for kind in SERVERS + FLOORS:
        if kind in short_medians:
            figures = short_medians[kind]
            lines.append(
                f"| {kind} | {figures['requests_per_s']:.0f} | {figures['latency_p50_ms']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--servers", default=",".join(SERVERS + FLOORS))
    parser.add_argument("--only", default="held,short,ttfb,stop,large")
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--short-s", type=int, default=20)
    parser.add_argument("--stop-count", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="sizes 100,1000; 5 s; 1 run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results.json")
    parser.add_argument("--table", type=Path, help="print a results file's medians as markdown")
    args = parser.parse_args()
    if args.table:
        print(table(args.table) + "\n\n" + floor_table(args.table))
        return
    if args.quick:
        args.runs, args.sizes, args.short_s, args.stop_count = 1, "100,1000", 5, 3
    if shutil.which("taskset") is None or shutil.which("wrk") is None:
        raise SystemExit("needs taskset and wrk (apt-get install util-linux wrk)")
    servers = args.servers.split(",")
    if "trio_gym_h11" in servers and importlib.util.find_spec("h11_mypyc") is None:
        servers.remove("trio_gym_h11")  # without the accelerator it would be trio_gym again
    only = set(args.only.split(","))
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def record(workload: str, kind: str, figures: dict[str, Any]) -> None:
        results.setdefault(workload, {}).setdefault(kind, []).append(figures)
        print(f"{workload:<12} {kind:<9} {json.dumps(figures)}", flush=True)

    with tempfile.TemporaryDirectory(prefix="trio-gym-bench-") as tmp:
        scratch = Path(tmp)
        for _ in range(args.runs):
            for kind in servers:
                if kind in FLOORS:
                    if "short" in only:
                        record("short", kind, short(kind, args.short_s, scratch))
                    continue
                if "held" in only:
                    for size in sizes:
                        record(f"held-{size}", kind, held(kind, size, scratch))
                if "short" in only:
                    record("short", kind, short(kind, args.short_s, scratch))
                if "ttfb" in only:
                    record("ttfb-1000", kind, ttfb(kind, scratch))
                if "stop" in only:
                    record("stop", kind, stop(kind, args.stop_count, scratch))
                if "large" in only:
                    record("large", kind, large(kind, scratch))
    summary = {w: {k: median_of(runs) for k, runs in by.items()} for w, by in results.items()}
    args.out.write_text(
        json.dumps({"runs": args.runs, "medians": summary, "all": results}, indent=1)
    )
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
