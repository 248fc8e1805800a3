"""NeMo Gym's own rollout collection beside a trio_gym host, on one real Gym 0.7.0 deployment.

    PYTHONPATH=. .venv/bin/python -m benchmarks.gym_peer            # 3 runs, medians; ~12 min
    PYTHONPATH=. .venv/bin/python -m benchmarks.gym_peer --rows 200 --cancel-rows 200 --runs 1
    PYTHONPATH=. .venv/bin/python -m benchmarks.gym_peer --table benchmarks/gym_results.json

Needs the real Gym environment (``scripts/gym_env.sh``; ``--gym-python`` names another). Once
per invocation it starts the model stub (``benchmarks/gym_stub_model.py``) and one Gym
deployment with Gym's own ``ng_run`` in its own session (Ray, a head server, the shipped
``example_single_tool_call`` weather resources server, a ``simple_agent``, a ``legacy_agent``
environment server in front of it, ``openai_model`` pointed at the stub; every server on the
venv that has nemo-gym, ``global_aiohttp_connector_limit_per_host=8192`` so no aiohttp pool caps
2,000 rows). The stub and every Gym process are pinned to CPU 0 (``taskset``; ``--no-pin``
pins nothing), every collecting process to CPU 1. Then, ``--runs`` times, alternately:

- **gym**: Gym's ``ng_collect_rollouts +head_server.host/port +input_jsonl_fpath
  +output_jsonl_fpath +num_samples_in_parallel=IN_FLIGHT +disable_aggregation=true
  +disable_health_check=true`` (asyncio + aiohttp, rows POSTed to the environment server's
  ``/run``; aggregation and health checks come after the last row and are off);
- **trio_gym**: a fresh ``python -m trio_gym serve --runner agents --head-server URL`` (agent
  connections allowed = rows in flight) plus ``python -m trio_gym run ROWS --url HOST --out OUT
  --chunk-size C --max-in-flight IN_FLIGHT/C`` (C = 8, the client's default: 8 requests of 8 at
  64 in flight, as `trio-gym run` runs by default).

Twice (``--capture off,on``): on a deployment as above, and on one with Gym's model-call and
token-ID capture switched on (``observability_enabled``, ``model_call_capture_dir``,
``token_id_capture.{enabled,all_agents,dir}``): Gym's collector is given the same switches, the
trio_gym host ``--gym-python`` (so every record is finished by Gym's own code in the host's
worker, and each row's captures cleared before it runs: its CPU is counted with the host's).
The stub answers with token ids, as a vLLM policy in training does. Cancel latency is measured
without capture only.

Scenarios (every row: "the weather in sf?", two model calls, the verifier's reward 1):

- ``fast``: the stub answers at once; ``--rows`` (2,000) rows, ``--in-flight`` (64) at once;
- ``think``: the stub answers each call after ``--think-s`` (1 s); all rows in flight at once.

Figures, per collector and scenario, medians over the runs:

- rows/s: rows / (the last row in the collector's hands - the first model call of the run);
  "in its hands": Gym's output file has the line (polled every 20 ms; Gym flushes each row),
  ``trio-gym run``'s progress line on stderr says so (polled likewise);
- CPU ms per row: utime+stime (+ reaped children's) of the collecting processes, from
  ``/proc/PID/stat`` sampled every 20 ms, between those same two moments (start-up excluded):
  Gym: ``ng_collect_rollouts`` and any descendants; trio_gym: the host + the client, and each
  of the two on its own;
- peak RSS: the sum of the collecting processes' ``VmHWM`` (``/proc/PID/status``, sampled; the
  client's also from ``wait4``'s ru_maxrss), in MiB and in KiB per row in flight;
- rows with a reward: lines of the collector's output carrying a reward; the rest are named;
- beside them, for the reader: the CPU ms per row of the deployment (the stub and every Gym
  process, all on CPU 0, the bottleneck here) over the same window, and the most model calls
  the stub had open at once (how many rows were really past Gym's servers at a time);
- cancel latency: the stub thinks ``--cancel-think-s`` (30 s); once every row has a model call
  open (the stub's count), SIGINT goes to the collector (Gym's collector; ``trio-gym run``)
  (SIGTERM, then SIGKILL, if it is still running 10 s later: recorded), and the time from the
  signal to the moment the stub saw the LAST of the calls open at the signal cut (its caller's
  connection ended) is the latency. ``fast``: 64 rows in flight; ``think``: ``--cancel-rows``
  (1,000). ``--cancel-reps`` per run and collector; the median over all.

Every model call is timed by the stub with ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for
every process), so stub times, signal times and polling times compare directly. Writes
``benchmarks/gym_results.json`` (every run's figures and the medians) and prints a markdown table.
Every process started is tagged with an environment variable and killed at the end (Gym's
session first, gracefully, then anything still carrying the tag); leftovers are reported.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TAG_VARIABLE = "TRIO_GYM_GYM_PEER_BENCH"
TICKS = os.sysconf("SC_CLK_TCK")
POLL_S = 0.02
GYM_START_TIMEOUT_S = 300.0
COLLECT_TIMEOUT_S = 600.0
COLLECTORS = ("gym", "trio_gym")
# Marks the workloads run with Gym's capture switched on.
CAPTURED = "+capture"
LABELS = {"gym": "Gym's collection", "trio_gym": "trio_gym host + trio-gym run"}
SCENARIOS = ("fast", "think")
TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
        "type": "function",
    }
]
# The deployment: Gym's shipped weather resources server, one agent, a legacy_agent
# environment server in front of it (rows naming the agent go through it, in both collectors).
WEATHER_CONFIG = """\
weather_tools:
  resources_servers:
    example_single_tool_call:
      entrypoint: app.py
      domain: agent
      verified: false
      description: the weather tool
weather_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server: {type: resources_servers, name: weather_tools}
      model_server: {type: responses_api_models, name: policy_model}
weather_env:
  environment_servers:
    legacy_agent:
      entrypoint: app.py
      agent_server: {type: responses_api_agents, name: weather_agent}
"""
SERVER_DIRS = (
    "resources_servers/example_single_tool_call",
    "responses_api_agents/simple_agent",
    "environment_servers/legacy_agent",
    "responses_api_models/openai_model",
)


# --- processes ----------------------------------------------------------------------------


TAG = secrets.token_hex(8)
STARTED: list[subprocess.Popen[bytes]] = []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pinned(cpu: int | None, argv: Sequence[str]) -> list[str]:
    return list(argv) if cpu is None else ["taskset", "-c", str(cpu), *argv]


def start(
    argv: Sequence[str], log: Path, *, env: dict[str, str], session: bool = False
) -> subprocess.Popen[bytes]:
    with log.open("ab") as sink:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**env, TAG_VARIABLE: TAG},
            cwd=log.parent,  # Gym writes Hydra's outputs/ where it runs: the scratch
            start_new_session=session,
        )
    STARTED.append(process)
    return process


def our_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMP_")}
    return {**env, "PYTHONPATH": str(ROOT)}


def tagged() -> list[int]:
    marker = f"{TAG_VARIABLE}={TAG}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in environ and state != "Z":
            found.append(int(entry.name))
    return found


def stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_of(pid: int) -> float | None:
    """utime + stime + cutime + cstime (reaped children included), seconds."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICKS


def hwm_of(pid: int) -> int | None:
    """VmHWM, bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def children_of(pids: set[int]) -> set[int]:
    """Every live descendant of ``pids``."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z":
                parent[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = set(pids)
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


class Tracker:
    """CPU and peak RSS of some processes (and their descendants), sampled over time."""

    def __init__(self, *, descendants: bool = True, peaks: bool = True) -> None:
        self.follow, self.peaks = descendants, peaks
        self.roots: dict[int, float] = {}  # pid -> last CPU seen (kept once it exits)
        self.descendants: dict[int, float] = {}  # dropped once gone: reaped into cutime
        self.hwm: dict[int, int] = {}
        self.samples: list[tuple[float, float]] = []
        self.root_samples: list[dict[int, float]] = []  # beside each sample: each root's own
        self._scanned = 0.0

    def add(self, pid: int) -> None:
        self.roots[pid] = 0.0

    def tick(self, now: float) -> None:
        if self.follow and now - self._scanned > 0.5:
            self._scanned = now
            for pid in children_of(set(self.roots)) - set(self.descendants):
                self.descendants[pid] = 0.0
        for table in (self.roots, self.descendants):
            for pid in list(table):
                cpu = cpu_of(pid)
                if cpu is None:
                    if table is self.descendants:
                        del table[pid]
                    continue
                table[pid] = cpu
                peak = hwm_of(pid) if self.peaks else None
                if peak is not None:
                    self.hwm[pid] = max(self.hwm.get(pid, 0), peak)
        self.samples.append((now, sum(self.roots.values()) + sum(self.descendants.values())))
        self.root_samples.append(dict(self.roots))

    def cpu_at(self, t: float, root: int | None = None) -> float:
        """CPU seconds at ``t``, interpolated: all, or one root's own (without descendants)."""
        times = [s[0] for s in self.samples]
        cpus = [
            c if root is None else r.get(root, 0.0)
            for (_, c), r in zip(self.samples, self.root_samples, strict=True)
        ]
        i = bisect.bisect_left(times, t)
        if i <= 0:
            return cpus[0]
        if i >= len(cpus):
            return cpus[-1]
        t0, t1, c0, c1 = times[i - 1], times[i], cpus[i - 1], cpus[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1

    def note_peak(self, pid: int, peak: int) -> None:
        self.hwm[pid] = max(self.hwm.get(pid, 0), peak)

    def peak(self) -> int:
        return sum(self.hwm.values())


def reap(process: subprocess.Popen[bytes]) -> tuple[int, int] | None:
    """Non-blocking: (exit code, ru_maxrss bytes) once ``process`` has exited."""
    if process.returncode is not None:
        return process.returncode, 0
    try:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
    except ChildProcessError:
        process.returncode = -1
        return -1, 0
    if pid == 0:
        return None
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, usage.ru_maxrss * 1024


def stop(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if process.returncode is not None or reap(process) is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if reap(process) is not None:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    while reap(process) is None:
        time.sleep(0.05)


def http_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.load(reply)


# --- the deployment -----------------------------------------------------------------------


class Stub:
    def __init__(self, scratch: Path, cpu: int | None) -> None:
        port_file = scratch / "stub.port"
        self.process = start(
            pinned(
                cpu,
                [sys.executable, str(ROOT / "benchmarks" / "gym_stub_model.py"), str(port_file)],
            ),
            scratch / "stub.log",
            env=our_env(),
            session=True,
        )
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise SystemExit("the stub model did not start; see " + str(scratch / "stub.log"))
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    def get(self, what: str) -> Any:
        return http_json(f"http://127.0.0.1:{self.port}/{what}")

    def open_calls(self) -> int:
        return int(self.get("stats")["open"])

    def calls(self) -> list[list[Any]]:
        return [c for c in self.get("calls") if c[0] >= 0]


class Gym:
    """One Gym deployment, started with Gym's own ``ng_run`` in a session of its own."""

    def __init__(
        self, python: str, scratch: Path, stub: Stub, cpu: int | None, *, capture: bool
    ) -> None:
        self.bin = Path(python).parent
        self.python = python
        self.head_port = free_port()
        venv = self.bin.parent
        scratch = scratch / ("gym-capture" if capture else "gym")
        scratch.mkdir()
        self.scratch = scratch
        """Its own folder: the collections on it name their files from 001 again."""
        venvs = scratch / "venvs"
        for server in SERVER_DIRS:
            (venvs / server).mkdir(parents=True)
            (venvs / server / ".venv").symlink_to(venv)
        config = scratch / "weather.yaml"
        config.write_text(WEATHER_CONFIG)
        argv = [
            str(self.bin / "ng_run"),
            f"+config_paths=[{config},responses_api_models/openai_model/configs/openai_model.yaml]",
            "+head_server.host=127.0.0.1",
            f"+head_server.port={self.head_port}",
            f"+policy_base_url=http://127.0.0.1:{stub.port}/v1",
            "+policy_api_key=stub-key",
            "+policy_model_name=stub",
            "+skip_venv_if_present=true",
            f"+uv_venv_dir={venvs}",
            "+global_aiohttp_connector_limit_per_host=8192",
        ]
        self.capture = capture
        # Gym's capture switches, for the deployment and for Gym's collector alike.
        self.capture_args = (
            [
                "+observability_enabled=true",
                f"+model_call_capture_dir={scratch / 'model-calls'}",
                "+token_id_capture.enabled=true",
                "+token_id_capture.all_agents=true",
                f"+token_id_capture.dir={scratch / 'tokens'}",
            ]
            if capture
            else []
        )
        argv += self.capture_args
        self.env = {
            k: v for k, v in os.environ.items() if not k.startswith("NMP_") and k != "PYTHONPATH"
        }
        self.env["PATH"] = f"{self.bin}{os.pathsep}{self.env.get('PATH', os.defpath)}"
        self.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray on 127.0.0.1
        self.env["PYTHONUNBUFFERED"] = "1"
        self.log = scratch / "gym.log"
        self.process = start(pinned(cpu, argv), self.log, env=self.env, session=True)
        self.started = time.monotonic()

    @property
    def head_url(self) -> str:
        return f"http://127.0.0.1:{self.head_port}"

    def wait_ready(self) -> float:
        while time.monotonic() - self.started < GYM_START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise SystemExit(f"Gym exited: {self.log.read_text()[-3000:]}")
            if "servers ready" in self.log.read_text(errors="replace"):
                http_json(f"{self.head_url}/global_config_dict_yaml")
                return time.monotonic() - self.started
            time.sleep(0.25)
        raise SystemExit(
            f"Gym not ready in {GYM_START_TIMEOUT_S} s: {self.log.read_text()[-3000:]}"
        )

    @staticmethod
    def affinities() -> dict[str, int]:
        """How many of the deployment's processes (Gym's and the stub) may run on which CPUs."""
        found: dict[str, int] = {}
        for pid in tagged():
            with contextlib.suppress(OSError):
                cpus = ",".join(map(str, sorted(os.sched_getaffinity(pid))))
                found[cpus] = found.get(cpus, 0) + 1
        return found

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (reap(self.process) is None or gym_leftovers()):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        stop(self.process, 1)


def gym_leftovers() -> list[int]:
    return tagged()


# --- the rows -----------------------------------------------------------------------------


def write_rows(path: Path, count: int, think_s: float) -> Path:
    think = f" [think {think_s}]" if think_s else ""
    with path.open("w") as file:
        for i in range(count):
            text = f"what is the weather in sf? [row {i}]{think}"
            row = {
                "agent_ref": {"name": "weather_agent"},
                "_ng_task_index": i,
                "_ng_rollout_index": 0,
                "responses_create_params": {
                    "input": [{"role": "user", "content": text}],
                    "tools": TOOLS,
                },
            }
            file.write(json.dumps(row) + "\n")
    return path


def rewards(paths: Sequence[Path]) -> tuple[int, int, list[str]]:
    """(lines with a reward, lines without, a few of the latter's reasons)."""
    good, bad, why = 0, 0, list[str]()
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if isinstance(record, dict) and record.get("reward") is not None:
                good += 1
            else:
                bad += 1
                if len(why) < 3:
                    why.append(line[:300])
    return good, bad, why


# --- one collection -----------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, scratch: Path, stub: Stub, gym: Gym) -> None:
        self.args = args
        self.scratch = scratch
        self.stub = stub
        self.gym = gym
        self.cpu = None if args.no_pin else 1
        self.serial = 0
        self.deployment = tagged()  # the stub and every Gym process, before any collector

    def _name(self, what: str) -> Path:
        self.serial += 1
        return self.scratch / f"{self.serial:03d}-{what}"

    def gym_collector(self, rows: Path, in_flight: int, out: Path) -> subprocess.Popen[bytes]:
        argv = [
            str(self.gym.bin / "ng_collect_rollouts"),
            "+head_server.host=127.0.0.1",
            f"+head_server.port={self.gym.head_port}",
            f"+input_jsonl_fpath={rows}",
            f"+output_jsonl_fpath={out}",
            f"+num_samples_in_parallel={in_flight}",
            "+disable_aggregation=true",
            "+disable_health_check=true",
            *self.gym.capture_args,
        ]
        return start(pinned(self.cpu, argv), out.with_suffix(".log"), env=self.gym.env)

    def trio_host(self, in_flight: int, name: Path) -> tuple[subprocess.Popen[bytes], int]:
        port_file = name.with_suffix(".port")
        env = {
            **our_env(),
            "NMP_AGENT_MAX_CONNECTIONS": str(max(in_flight, 64)),
            "NMP_MAX_CONNECTIONS": "20000",
            "NMP_MAX_BATCHES": "20000",
        }
        argv = [sys.executable, "-m", "trio_gym", "serve", "--runner", "agents"]
        argv += ["--head-server", self.gym.head_url, "--port", "0", "--port-file", str(port_file)]
        if self.gym.capture:  # every record finished by Gym's own code, in the host's worker
            argv += ["--gym-python", self.gym.python]
        host = start(pinned(self.cpu, argv), name.with_suffix(".host.log"), env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if host.poll() is not None:
                raise SystemExit(
                    f"the host exited: {name.with_suffix('.host.log').read_text()[-2000:]}"
                )
            if port_file.exists() and port_file.read_text():
                port = int(port_file.read_text())
                with contextlib.suppress(OSError):
                    if http_json(f"http://127.0.0.1:{port}/health", 5).get("status") == "ready":
                        return host, port
            time.sleep(0.05)
        raise SystemExit("the trio_gym host did not become ready")

    def trio_client(
        self, rows: Path, in_flight: int, port: int, out: Path
    ) -> subprocess.Popen[bytes]:
        chunk = (
            self.args.fast_chunk_size if in_flight <= self.args.in_flight else self.args.chunk_size
        )
        argv = [sys.executable, "-m", "trio_gym", "run", str(rows)]
        argv += ["--url", f"http://127.0.0.1:{port}", "--out", str(out)]
        argv += ["--chunk-size", str(chunk), "--max-in-flight", str(max(1, in_flight // chunk))]
        return start(pinned(self.cpu, argv), out.with_suffix(".log"), env=our_env())

    def collect(
        self, kind: str, scenario: str, rows: Path, count: int, in_flight: int
    ) -> dict[str, Any]:
        self.stub.get("reset")
        name = self._name(f"{kind}-{scenario}")
        out = name.with_suffix(".jsonl")
        tracker = Tracker()
        deployment = Tracker(descendants=False, peaks=False)
        for pid in self.deployment:
            deployment.add(pid)
        host = None
        if kind == "gym":
            collector = self.gym_collector(rows, in_flight, out)
            watched = [out, out.with_name(out.stem + "_failures.jsonl")]
            counters = [LineCounter(path) for path in watched]
            done: Callable[[], int] = lambda: sum(count() for count in counters)  # noqa: E731
        else:
            host, port = self.trio_host(in_flight, name)
            tracker.add(host.pid)
            collector = self.trio_client(rows, in_flight, port, out)
            done = partial(_progress, out.with_suffix(".log"))
        tracker.add(collector.pid)
        finished_at: float | None = None
        finished, exit_peak = 0, 0
        code: int | str | None = None
        started = time.monotonic()
        while time.monotonic() - started < COLLECT_TIMEOUT_S:
            now = time.monotonic()
            count_now = done()
            tracker.tick(now)
            deployment.tick(now)
            if count_now > finished:
                finished, finished_at = count_now, now
            ended = reap(collector)
            if ended is not None:
                code, exit_peak = ended
                break
            time.sleep(POLL_S)
        else:
            stop(collector, 1)
            code = "timeout"
        tracker.note_peak(collector.pid, exit_peak)
        if host is not None:
            tracker.tick(time.monotonic())
            stop(host)
        if kind == "gym":
            good, bad, why = rewards([out, out.with_name(out.stem + "_failures.jsonl")])
        else:
            good, bad, why = rewards([out])
        calls = self.stub.calls()
        first = min((c[2] for c in calls), default=started)
        end = finished_at or time.monotonic()
        elapsed = end - first
        cpu = tracker.cpu_at(end) - tracker.cpu_at(first)
        peak = tracker.peak()
        return {
            "rows": count,
            "in_flight": in_flight,
            "exit": code,
            "finished": finished,
            "with_reward": good,
            "without_reward": count - good,
            "failed_lines": why,
            "seconds": elapsed,
            "rows_per_s": good / elapsed if elapsed > 0 else None,
            "cpu_s": cpu,
            "cpu_ms_per_row": 1000 * cpu / count,
            **(
                {}
                if host is None
                else {
                    f"cpu_ms_per_row_{name}": 1000
                    * (tracker.cpu_at(end, pid) - tracker.cpu_at(first, pid))
                    / count
                    for name, pid in (("host", host.pid), ("client", collector.pid))
                }
            ),
            "cpu_total_s": tracker.samples[-1][1] if tracker.samples else None,
            "deployment_cpu_ms_per_row": 1000
            * (deployment.cpu_at(end) - deployment.cpu_at(first))
            / count,
            "peak_rss_mib": peak / 2**20,
            "peak_rss_kib_per_row_in_flight": peak / 1024 / in_flight,
            "model_calls": len(calls),
            "max_model_calls_open": max_open(calls),
            "bad_lines_seen": bad,
        }

    def cancel(self, kind: str, rows: Path, count: int) -> dict[str, Any]:
        self.stub.get("reset")
        name = self._name(f"{kind}-cancel{count}")
        out = name.with_suffix(".jsonl")
        host = None
        if kind == "gym":
            collector = self.gym_collector(rows, count, out)
        else:
            host, port = self.trio_host(count, name)
            collector = self.trio_client(rows, count, port, out)
        deadline = time.monotonic() + 180
        while self.stub.open_calls() < count:
            if time.monotonic() > deadline or collector.poll() is not None:
                stop(collector, 1)
                if host is not None:
                    stop(host)
                raise SystemExit(f"{kind}: the {count} model calls never were all open ({name})")
            time.sleep(POLL_S)
        signalled = time.monotonic()
        collector.send_signal(signal.SIGINT)
        signals = ["SIGINT"]
        exited_at = None
        while time.monotonic() - signalled < 40:
            now = time.monotonic()
            if exited_at is None and reap(collector) is not None:
                exited_at = now
            if exited_at is None and now - signalled > 10 and len(signals) == 1:
                collector.send_signal(signal.SIGTERM)
                signals.append("SIGTERM")
            if exited_at is None and now - signalled > 20 and len(signals) == 2:
                collector.kill()
                signals.append("SIGKILL")
            if exited_at is not None and self.stub.open_calls() == 0:
                break
            time.sleep(POLL_S)
        if host is not None:
            stop(host)
        calls = self.stub.calls()
        at_signal = [c for c in calls if c[2] < signalled and (c[3] is None or c[3] > signalled)]
        cut = [c[3] for c in at_signal if c[4] == "cut"]
        time.sleep(1.0)  # Gym's servers finish unwinding before the next measurement
        return {
            "rows": count,
            "open_at_signal": len(at_signal),
            "cut": len(cut),
            "never_cut": len(at_signal) - len(cut),
            "signals": signals,
            "collector_exit_ms": None if exited_at is None else 1000 * (exited_at - signalled),
            "first_cut_ms": 1000 * (min(cut) - signalled) if cut else None,
            "median_cut_ms": 1000 * (statistics.median(cut) - signalled) if cut else None,
            "cancel_latency_ms": 1000 * (max(cut) - signalled) if cut else None,
        }


class LineCounter:
    """Lines written to a file so far, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.lines = 0

    def __call__(self) -> int:
        with contextlib.suppress(OSError), self.path.open("rb") as file:
            file.seek(self.offset)
            data = file.read()
            self.offset += len(data)
            self.lines += data.count(b"\n")
        return self.lines


def _progress(log: Path) -> int:
    """Examples done, from ``trio-gym run``'s last progress line."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, log.stat().st_size - 400))
            tail = file.read().decode(errors="replace")
    except OSError:
        return 0
    for line in reversed(tail.splitlines()):
        if "examples done" in line:
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split("]", 1)[1].split("/", 1)[0])
    return 0


def max_open(calls: list[list[Any]]) -> int:
    events = sorted([(c[2], 1) for c in calls] + [(c[3], -1) for c in calls if c[3] is not None])
    most = running = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


# --- the run ------------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"runs": len(runs)}
    for key in runs[0]:
        values = [run.get(key) for run in runs]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers and len(numbers) == len([v for v in values if v is not None]):
            merged[key] = statistics.median(numbers)
        else:
            merged[key] = values[-1]
    return merged


ROWS: list[tuple[str, str, str, str]] = [
    # (section, figure, label, format)
    ("collect", "rows_per_s", "rows/s (first model call → last row in hand)", "{:.1f}"),
    ("collect", "cpu_ms_per_row", "CPU ms per row (collecting processes)", "{:.2f}"),
    ("collect", "cpu_ms_per_row_host", "… of which the trio_gym host", "{:.2f}"),
    ("collect", "cpu_ms_per_row_client", "… of which `trio-gym run`", "{:.2f}"),
    ("collect", "peak_rss_mib", "peak RSS (MiB, collecting processes)", "{:.0f}"),
    ("collect", "peak_rss_kib_per_row_in_flight", "peak RSS KiB per row in flight", "{:.1f}"),
    (
        "collect",
        "deployment_cpu_ms_per_row",
        "Gym's servers + stub (CPU 0): CPU ms per row",
        "{:.2f}",
    ),
    ("collect", "max_model_calls_open", "most model calls open at once", "{:.0f}"),
    ("cancel", "cancel_latency_ms", "cancel latency: signal → last call cut (ms)", "{:.0f}"),
    ("cancel", "collector_exit_ms", "signal → collector exited (ms)", "{:.0f}"),
    ("collect", "with_reward", "rows with a reward (median)", "{:.0f}"),
    ("collect", "without_reward", "rows without a reward (worst run)", "{:.0f}"),
]


def table(document: dict[str, Any]) -> str:
    """The medians as markdown: one table per capture mode run (capture on: collection only)."""
    medians = document["medians"]
    sizes = document["sizes"]
    head = ["figure"]
    for scenario in SCENARIOS:
        for kind in COLLECTORS:
            head.append(f"{LABELS[kind]} — {sizes[scenario]}")
    tables = []
    modes = (("", "capture off"), (CAPTURED, "Gym's model-call and token-ID capture on"))
    for mark, title in modes:
        if not any(key.endswith(CAPTURED) == bool(mark) for key in medians):
            continue
        lines = [f"{title}:", "", "| " + " | ".join(head) + " |"]
        lines.append("|---|" + "---|" * (len(head) - 1))
        for section, figure, label, form in ROWS:
            if mark and section != "collect":
                continue
            cells = []
            for scenario in SCENARIOS:
                for kind in COLLECTORS:
                    workload = f"{section}-{scenario}{mark if section == 'collect' else ''}"
                    value = medians.get(workload, {}).get(kind, {}).get(figure)
                    if figure == "without_reward":
                        every = document["all"].get(workload, {}).get(kind, [])
                        value = max((run[figure] for run in every), default=None)
                    cells.append("—" if value is None else form.format(value))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def gym_python(named: str) -> str:
    if named:
        return named
    found = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gym_env.sh")], capture_output=True, text=True
    )
    if found.returncode != 0:
        raise SystemExit(f"no real Gym here (scripts/gym_env.sh: {found.stderr.strip()[-500:]})")
    return found.stdout.strip().splitlines()[-1]


def git(*args: str) -> str:
    found = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
    return found.stdout.strip()


def cleanup(gym: Gym | None) -> list[str]:
    """Stop everything started; return what was still running after (should be nothing)."""
    for process in reversed(STARTED):
        if gym is None or process is not gym.process:
            with contextlib.suppress(Exception):
                stop(process, 5)
    if gym is not None:
        gym.stop()
    for pid in tagged():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    left = subprocess.run(["ps", "-eo", "pid,pgid,args"], capture_output=True, text=True).stdout
    return [line for line in left.splitlines()[1:] if int(line.split()[0]) in set(tagged())]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=64, help="scenario fast")
    parser.add_argument("--think-s", type=float, default=1.0, help="scenario think")
    parser.add_argument("--chunk-size", type=int, default=8, help="trio-gym run, scenario think")
    parser.add_argument(
        "--fast-chunk-size", type=int, default=8, help="trio-gym run, scenario fast (its default)"
    )
    parser.add_argument("--cancel-rows", type=int, default=1000, help="scenario think's cancel")
    parser.add_argument("--cancel-think-s", type=float, default=30.0)
    parser.add_argument("--cancel-reps", type=int, default=1, help="per run and collector")
    parser.add_argument("--only", default="fast,think,cancel")
    parser.add_argument(
        "--capture", default="off,on", help="Gym's capture off, on, or both (off,on), in turn"
    )
    parser.add_argument("--gym-python", default="")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "gym_results.json")
    parser.add_argument("--table", type=Path, help="print a results file's medians as markdown")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    only = set(args.only.split(","))
    python = gym_python(args.gym_python)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # A shell's background job starts with SIGINT ignored, and an ignored signal stays ignored in
    # every process exec'd after: the collectors' SIGINT would do nothing. Caught here, it is
    # back to the default in each of them.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    began = time.monotonic()
    gym = None

    def record(workload: str, kind: str, figures: dict[str, Any]) -> None:
        results.setdefault(workload, {}).setdefault(kind, []).append(figures)
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
        print(
            f"[{time.monotonic() - began:6.0f}s] {workload:<12} {kind:<8} {json.dumps(shown)}",
            flush=True,
        )

    with tempfile.TemporaryDirectory(prefix="trio-gym-gym-peer-") as tmp:
        scratch = Path(tmp)
        leftovers: list[str] = []
        try:
            server_cpu = None if args.no_pin else 0
            stub = Stub(scratch, server_cpu)
            fast_rows = write_rows(scratch / "fast.jsonl", args.rows, 0)
            think_rows = write_rows(scratch / "think.jsonl", args.rows, args.think_s)
            cancel_fast = write_rows(
                scratch / "cancel-fast.jsonl", args.in_flight, args.cancel_think_s
            )
            cancel_think = write_rows(
                scratch / "cancel-think.jsonl", args.cancel_rows, args.cancel_think_s
            )
            for capture in args.capture.split(","):
                if gym is not None:
                    gym.stop()
                gym = Gym(python, scratch, stub, server_cpu, capture=capture == "on")
                startup_s = gym.wait_ready()
                affinities = gym.affinities()
                print(
                    f"Gym (capture {capture}) up in {startup_s:.1f} s; its processes' CPU "
                    f"affinities: {affinities}",
                    flush=True,
                )
                bench = Bench(args, gym.scratch, stub, gym)
                mark = "" if capture == "off" else CAPTURED
                for _ in range(args.runs):
                    for kind in COLLECTORS:
                        if "fast" in only:
                            record(
                                f"collect-fast{mark}",
                                kind,
                                bench.collect(kind, "fast", fast_rows, args.rows, args.in_flight),
                            )
                    for kind in COLLECTORS:
                        if "think" in only:
                            record(
                                f"collect-think{mark}",
                                kind,
                                bench.collect(kind, "think", think_rows, args.rows, args.rows),
                            )
                    cancels = (
                        ("cancel-fast", cancel_fast, args.in_flight),
                        ("cancel-think", cancel_think, args.cancel_rows),
                    )
                    for _rep in range(args.cancel_reps if capture == "off" else 0):
                        for scenario, rows, count in cancels if "cancel" in only else ():
                            for kind in COLLECTORS:
                                record(scenario, kind, bench.cancel(kind, rows, count))
        finally:
            leftovers = cleanup(gym)
    summary = {w: {k: median_of(runs) for k, runs in by.items()} for w, by in results.items()}
    document = {
        "runs": args.runs,
        "commit": git("rev-parse", "HEAD"),
        "trio_gym_uncommitted": git("status", "--porcelain", "trio_gym"),
        "sizes": {
            "fast": f"fast: {args.rows} rows, {args.in_flight} in flight",
            "think": f"think {args.think_s:g} s: {args.rows} rows, all in flight",
        },
        "settings": {k: str(v) for k, v in vars(args).items()},
        "pinned": None if args.no_pin else {"gym_and_stub": 0, "collectors": 1},
        "gym_affinities": affinities,
        "gym_startup_s": startup_s,
        "wall_s": time.monotonic() - began,
        "leftover_processes": leftovers,
        "medians": summary,
        "all": results,
    }
    args.out.write_text(json.dumps(document, indent=1))
    print(table(document))
    print(f"\nwall time {document['wall_s']:.0f} s; leftover processes: {leftovers or 'none'}")


if __name__ == "__main__":
    main()
