"""What the real NeMo Gym suite (``tests/test_gym_real.py``) runs: an environment package built
from Gym's own shipped weather example, the operator's Gym config, hosts launched as a sandbox
orchestrator launches them, and the rows.

The environment package holds the ``example_single_tool_call`` resources server (its code, from
the installed nemo-gym) and a config that fronts two ``simple_agent``s: one with a
``legacy_agent`` environment server (a relay: an agent's failure is its HTTP 500), one with a
``single_agent_turn_legacy`` environment server (a failure is a record with
``_ng_failure_class``). The model is ``openai_model`` pointed at ``tests/stub_model.py``.

Gym builds a venv per server unless one is there; the suite points every server at the venv
that has nemo-gym (``skip_venv_if_present`` + ``uv_venv_dir``), which is how it runs offline
and fast. The real-Gym interpreter comes from ``scripts/gym_env.sh``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import attrs
import yaml

from tests.processes import kill_all, processes_with

VERSION: Final = "0.7.0"
REPO: Final = Path(__file__).resolve().parent.parent
# The servers of the weather deployment, as Gym names their directories (its venv layout).
SERVER_DIRS: Final = (
    "resources_servers/example_single_tool_call",
    "responses_api_agents/simple_agent",
    "environment_servers/legacy_agent",
    "environment_servers/single_agent_turn_legacy",
    "responses_api_models/openai_model",
)
DEPLOYMENT_VARIABLE: Final = "TRIO_GYM_GYM_DEPLOYMENT"
TOOLS: Final = [
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


def real_gym_python() -> str | None:
    """The interpreter with real nemo-gym: ``TRIO_GYM_REAL_GYM_PYTHON``, else the one
    ``scripts/gym_env.sh`` finished building; ``None`` when there is none."""
    named = os.environ.get("TRIO_GYM_REAL_GYM_PYTHON")
    if named:
        return named
    cache_root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = Path(os.environ.get("TRIO_GYM_CACHE") or Path(cache_root) / "trio-gym")
    venv = cache / f"nemo-gym-{VERSION}"
    return str(venv / "bin" / "python") if (venv / ".trio-gym-complete").exists() else None


def gym_wheelhouse(python: str) -> Path | None:
    """Every wheel of nemo-gym's closure, beside the environment (``scripts/gym_env.sh``
    downloads it), or ``None`` when it is not there."""
    wheels = Path(python).parent.parent.with_name(f"nemo-gym-{VERSION}-wheels")
    return wheels if (wheels / ".trio-gym-complete").exists() else None


def gym_site(python: str) -> Path:
    """Where the installed nemo-gym keeps its shipped servers."""
    probe = "import nemo_gym, pathlib; print(pathlib.Path(nemo_gym.__file__).parent.parent)"
    return Path(subprocess.check_output([python, "-c", probe], text=True).strip())


WEATHER_CONFIG: Final = {
    "weather_tools": {
        "resources_servers": {
            "example_single_tool_call": {
                "entrypoint": "app.py",
                "domain": "agent",
                "verified": False,
                "description": "the weather tool",
            }
        }
    },
    "weather_agent": {
        "responses_api_agents": {
            "simple_agent": {
                "entrypoint": "app.py",
                "resources_server": {"type": "resources_servers", "name": "weather_tools"},
                "model_server": {"type": "responses_api_models", "name": "policy_model"},
            }
        }
    },
    "weather_env": {
        "environment_servers": {
            "legacy_agent": {
                "entrypoint": "app.py",
                "agent_server": {"type": "responses_api_agents", "name": "weather_agent"},
            }
        }
    },
    "weather_session_agent": {
        "responses_api_agents": {
            "simple_agent": {
                "entrypoint": "app.py",
                "resources_server": {"type": "resources_servers", "name": "weather_tools"},
                "model_server": {"type": "responses_api_models", "name": "policy_model"},
            }
        }
    },
    "weather_turn_env": {
        "environment_servers": {
            "single_agent_turn_legacy": {
                "entrypoint": "app.py",
                "resources_server": {"type": "resources_servers", "name": "weather_tools"},
                "agent_server": {"type": "responses_api_agents", "name": "weather_session_agent"},
                "resources_tool_transports": ["direct_http"],
                "max_concurrent_episodes": None,
                "queue_timeout_seconds": None,
                "default_episode_timeout_seconds": 21600,
                "cleanup_timeout_seconds": 180,
            }
        }
    },
}


def weather_package(root: Path, site: Path) -> Path:
    """A native-v1 environment package: Gym's weather tool and the config above."""
    server = root / "resources_servers" / "example_single_tool_call"
    shutil.copytree(
        site / "resources_servers" / "example_single_tool_call",
        server,
        ignore=shutil.ignore_patterns("data", "tests", "__pycache__"),  # packages hold no data
    )
    config = "resources_servers/example_single_tool_call/configs/weather.yaml"
    (root / config).write_text(yaml.safe_dump(WEATHER_CONFIG))
    manifest = {"format": "native-v1", "config_paths": [config], "metadata": {"name": "weather"}}
    (root / "nemo-environment.yaml").write_text(yaml.safe_dump(manifest))
    return root


def prebuilt_venvs(root: Path, python: str, *, leave_out: tuple[str, ...] = ()) -> Path:
    """Gym's per-server venv layout, every server pointing at the venv that has nemo-gym."""
    venv = Path(python).parent.parent
    for server in SERVER_DIRS:
        if server not in leave_out:
            (root / server).mkdir(parents=True)
            (root / server / ".venv").symlink_to(venv)
    return root


def gym_global_config(model_url: str, venvs: Path, captures: Path | None = None) -> dict[str, Any]:
    """What the operator hands the host as NMP_GYM_GLOBAL_CONFIG: the model, built venvs, and
    with ``captures`` Gym's model-call and token-ID capture switched on (:func:`capture`)."""
    return {
        "policy_base_url": model_url,
        "policy_api_key": "stub-key",
        "policy_model_name": "stub",
        "config_paths": ["responses_api_models/openai_model/configs/openai_model.yaml"],
        "skip_venv_if_present": True,
        "uv_venv_dir": str(venvs),
        "environment_server_routes": {"example_single_tool_call": "weather_turn_env"},
        **({} if captures is None else capture(captures)),
    }


def capture(captures: Path) -> dict[str, Any]:
    """Gym's switches for model-call capture and token-ID capture of every agent, into
    ``captures/model-calls`` and ``captures/tokens``."""
    return {
        "observability_enabled": True,
        "model_call_capture_dir": str(captures / "model-calls"),
        "token_id_capture": {"enabled": True, "all_agents": True, "dir": str(captures / "tokens")},
    }


def gyms_own_collection(
    python: str, head: str, rows: list[dict[str, Any]], out: Path, captures: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows through Gym's own ``ng_collect_rollouts`` against the deployment whose head
    server is at ``head`` (host:port), with the same capture switches and failures routed to
    its sidecar: its records and its failure records, by row order."""
    rows_file = out.with_suffix(".rows.jsonl")
    rows_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    switches = capture(captures)
    host, port = head.rsplit(":", 1)
    argv = [
        str(Path(python).parent / "ng_collect_rollouts"),
        f"+head_server.host={host}",
        f"+head_server.port={port}",
        f"+input_jsonl_fpath={rows_file}",
        f"+output_jsonl_fpath={out}",
        "+disable_aggregation=true",
        "+disable_health_check=true",
        "+route_failures_to_sidecar=true",
        "+observability_enabled=true",
        f"+model_call_capture_dir={switches['model_call_capture_dir']}",
        "+token_id_capture.enabled=true",
        "+token_id_capture.all_agents=true",
        f"+token_id_capture.dir={switches['token_id_capture']['dir']}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NMP_") and k != "PYTHONPATH"}
    env["PATH"] = f"{Path(python).parent}{os.pathsep}{env.get('PATH', os.defpath)}"
    done = subprocess.run(
        argv, env=env, cwd=out.parent, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_jsonl(out), read_jsonl(out.with_name(f"{out.stem}_failures.jsonl"))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# What differs between two collections of the same rows: when things happened, and the ids the
# stub model and Gym mint per call. Everything else must be equal.
VOLATILE_KEYS: Final = frozenset(
    {
        "started_at",
        "completed_at",
        "timestamp",
        "latency_total_ms",
        "latency_ttft_ms",
        "duration_ms",
        "total_latency_ms",
        "model_call_id",
        "response_id",
        "id",
        "call_id",
        "tool_call_id",
    }
)


def comparable(value: Any) -> Any:
    """``value`` with every :data:`VOLATILE_KEYS` value, at any depth, replaced by ``"…"``."""
    if isinstance(value, dict):
        return {k: "…" if k in VOLATILE_KEYS else comparable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [comparable(item) for item in value]
    return value


def by_identity(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in records}


def row(agent: str, text: str, task: int, **extra: Any) -> dict[str, Any]:
    params = {"input": [{"role": "user", "content": text}], "tools": TOOLS}
    return {
        "agent_ref": {"name": agent},
        "_ng_task_index": task,
        "_ng_rollout_index": 0,
        "responses_create_params": params,
        **extra,
    }


def taskset_row(text: str, task: int) -> dict[str, Any]:
    params = {"input": [{"role": "user", "content": text}], "tools": TOOLS}
    return {
        "task_id": {"taskset": "example_single_tool_call", "task_id": str(task)},
        "task_input": {"responses_create_params": params},
        "_ng_task_index": task,
        "_ng_rollout_index": 0,
    }


@attrs.frozen
class Stub:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=10) as reply:
            stats: dict[str, int] = json.load(reply)
            return stats


@attrs.frozen
class RealGym:
    python: str
    site: Path
    stub: Stub


@attrs.frozen
class Launched:
    process: subprocess.Popen[bytes]
    log: Path

    def events(self) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events() if e["event"] == name), None)


@contextmanager
def launched_host(
    workdir: Path, python: str, package: Path, gym_config: dict[str, Any], **extra_env: str
) -> Iterator[Launched]:
    """``trio-gym serve`` as the upstream orchestrator launches it: every setting through
    NMP_* variables, no runner named, a port and no address."""
    env = {
        **os.environ,
        "NMP_JOB_ID": "real-gym",
        "NMP_ENVIRONMENT_PATH": str(package),
        "NMP_ENVIRONMENT_PACKAGE_REQUIRED": "1",
        "NMP_DATASET_PATH": str(workdir / "dataset"),
        "NMP_WORK_PATH": str(workdir / "work"),
        "NMP_MAX_REQUEST_BYTES": str(268_435_456),
        "NMP_MAX_RESPONSE_BYTES": str(268_435_456),
        "NMP_BROKER_URL": "http://127.0.0.1:9/broker",
        "NMP_BROKER_TOKEN": "broker-token",
        "NMP_GYM_GLOBAL_CONFIG": json.dumps(gym_config),
        "NMP_RUNTIME_HTTP_PORT": "0",
        "NMP_GYM_PYTHON": python,
        "NMP_GYM_STOP_GRACE_S": "5",
        "NMP_AGENT_RETRY_BACKOFF_S": "0.2",
        **extra_env,
    }
    log = workdir / "host.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(  # from this checkout: its trio_gym, not an installed one
            [sys.executable, "-m", "trio_gym", "serve"], stderr=sink, env=env, cwd=REPO
        )
    launched = Launched(process, log)
    try:
        yield launched
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        starting = launched.event("gym_starting")
        if starting is not None:  # what a failed test may have left of Gym
            kill_all(DEPLOYMENT_VARIABLE, starting["deployment"])


def tagged_processes(tag: str) -> list[int]:
    """Every live process of one Gym deployment (the tag is inherited by all of them)."""
    return processes_with(DEPLOYMENT_VARIABLE, tag)


def environment_of(pid: int) -> dict[str, str]:
    pairs = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)
