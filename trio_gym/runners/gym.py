"""The ``gym`` runner: the host starts the environment's own NeMo Gym deployment and owns it.

Gym is started with Gym's own launcher (``gym env start``, what ``ng_run`` runs) by the Python
that has ``nemo_gym`` (``gym_python``; by default this interpreter, when ``nemo_gym`` imports
here). Its global config is the caller's ``gym_global_config`` (``NMP_GYM_GLOBAL_CONFIG``) with
the environment package's ``config_paths`` (resolved inside the package) in front of the
caller's own, and a head server on a loopback port the host chooses unless the config names
one. The package root is Gym's first search root (``NEMO_GYM_EXTRA_ROOTS``), so its servers are
found there before Gym's built-in ones; Gym works in ``<work_path>/gym`` (its caches, results
and per-server venvs), never in the package.

The whole deployment — Gym's launcher, Ray, every server — is one process tree under the
host's guard (:mod:`trio_gym.processes`): stopped with the host (SIGTERM, then SIGKILL after
``gym_stop_grace_s``), and with a host killed outright too. The host is ``starting`` (stage
``starting_gym``) until the head server's ``/health`` is 200 and every server it lists answers,
within ``gym_start_timeout_s``. Rows then go through the native :mod:`.agents` machinery via
that head server. If Gym exits, before or after it was ready, the host is ``failed`` with the
end of Gym's output.

Gym's children inherit the host's environment as the installer stage left it (``UV_OFFLINE``,
``UV_FIND_LINKS``, ``PYTHONPATH``: Gym's per-server venv builds are what they govern), plus
``NMP_DATASET_PATH`` / ``NMP_BROKER_URL`` / ``NMP_BROKER_TOKEN`` from the config, the Gym
Python's directory first on ``PATH`` (as if Gym's environment were activated), this host's ``uv``
last on ``PATH`` when there is none (Gym's builds call ``uv``), and never the host's control
token.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping, MutableMapping
from functools import partial
from pathlib import Path
from typing import Any, Final, Literal

import attrs
import trio
import yaml

from trio_gym.config import ServeConfig
from trio_gym.errors import bounded
from trio_gym.http import Endpoint, HttpLimits, StreamOpener, open_tcp
from trio_gym.install import EnvironmentPackage, InstallError, find_uv
from trio_gym.logs import log_event
from trio_gym.processes import ProcessTree, run_process_tree

from .deployment import AgentError, wait_for_deployment

# Gym's own command line entry (the `gym` console script), run by an interpreter given by path:
# `python -m nemo_gym.cli.main` runs nothing (the module has no __main__ block).
LAUNCHER: Final = "import sys; from nemo_gym.cli.main import main; sys.argv[0] = 'gym'; main()"
# The upstream orchestrator's component choice inside the Gym config; not Gym's own key.
SELECTION_KEY: Final = "_nmp_environment_component_selection"
# Marks every process of one deployment (environment variables are inherited): for operators
# and tests that want to find them all.
DEPLOYMENT_VARIABLE: Final = "TRIO_GYM_GYM_DEPLOYMENT"
# Never handed to Gym: the environment's code has no business with the host's control plane.
WITHHELD_VARIABLES: Final = ("NMP_CONTROL_TOKEN",)
# How long removing a scratch working directory may hold up a stop.
REMOVE_SCRATCH_S: Final = 30.0
# How long asking an interpreter whether it has nemo_gym may take.
PYTHON_CHECK_TIMEOUT_S: Final = 60.0
LOOPBACK: Final = "127.0.0.1"
GLOBAL_CONFIG_NAME: Final = "trio-gym-global-config.yaml"
"""The config Gym starts from, in its working directory."""
# AF_UNIX socket paths are at most 107 bytes (108 with the terminating NUL) on Linux. Ray puts
# its sockets at <temp>/ray/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store,
# its longest; the session's part is at most this long (a 7-digit pid).
INDEX_UNREACHABLE: Final = re.compile(
    r"^\((?P<server>[^)\s]+)\) .*Failed to fetch: `?(?P<url>[^\s`]+)"
)
"""uv's word, in Gym's output prefixed with the server it builds, that it could not reach an
index: the first such line is the cause of a start that then fails."""
UNIX_SOCKET_PATH_LIMIT: Final = 107
RAY_SOCKET_EXAMPLE: Final = "ray/session_2026-12-02_14-07-46_123456_1234567/sockets/plasma_store"


class GymStartFailed(Exception):
    """The deployment could not be started; the message says why and what to change."""


def gym_python(configured: str, purpose: str = "runner 'gym'") -> str:
    """The interpreter with nemo_gym (to run Gym with, or to finalize its records with):
    ``configured``, else this one if it has nemo_gym. Raises :class:`GymStartFailed` saying
    what ``purpose`` needs and how to give it."""
    if configured:
        return configured
    if importlib.util.find_spec("nemo_gym") is not None:
        return sys.executable
    raise GymStartFailed(
        f"{purpose} needs a Python that can import nemo_gym, and the host's own "
        f"({sys.executable}) cannot; name one with --gym-python (NMP_GYM_PYTHON) — nemo-gym "
        "needs Python 3.13 (scripts/gym_env.sh builds one)"
        + (" — or run a deployment yourself and use --runner agents --head-server URL")
        * (purpose == "runner 'gym'")
    )


async def check_gym_python(python: str) -> None:
    """Raise :class:`GymStartFailed` unless ``python`` runs and can import nemo_gym (found
    without importing it, which takes seconds)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('nemo_gym') is None)"
    try:
        with trio.fail_after(PYTHON_CHECK_TIMEOUT_S):
            result = await trio.run_process(
                [python, "-c", probe],
                stdin=b"",
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    except OSError as exc:
        raise GymStartFailed(f"cannot run the Gym Python {python!r}: {exc}") from exc
    except trio.TooSlowError as exc:
        raise GymStartFailed(f"the Gym Python {python!r} did not answer within 60 s") from exc
    if result.returncode != 0:
        raise GymStartFailed(
            f"the Gym Python {python!r} cannot import nemo_gym; install nemo-gym there or name "
            "another with --gym-python (NMP_GYM_PYTHON)"
        )


def gym_global_config(
    given: Mapping[str, Any],
    package: EnvironmentPackage | None,
    *,
    head_port: int,
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """Gym's global config: ``given`` with the package's configs, a head server, and the
    operator's uv directories.

    - ``config_paths``: the package's (absolute, inside the package) first; then, with the
      upstream orchestrator's component choice (``_nmp_environment_component_selection``),
      what it adds as the upstream host adds it — the operator's model config always, the
      agent's and the resources server's configs only for what the package does not declare
      (resolved by Gym from its search roots) — *in place of* ``given``'s own list, which the
      orchestrator always sends and which would load the image's components beside the
      package's; without a choice, ``given``'s own list after the package's.
    - ``head_server``: ``127.0.0.1:head_port`` unless ``given`` names it.
    - ``uv_cache_dir`` / ``uv_venv_dir``: from ``UV_CACHE_DIR`` / ``NEMO_GYM_VENV_DIR`` when set
      and ``given`` does not name them (Gym overwrites ``UV_CACHE_DIR`` from its config).

    Raises :class:`GymStartFailed` for a component choice that cannot be honoured.
    """
    config = copy.deepcopy(dict(given))
    selection = config.pop(SELECTION_KEY, None)
    paths: list[str] = []
    if package is not None:
        paths.extend(str(package.root / path) for path in package.config_paths)
    own = config.get("config_paths") or []
    if not isinstance(own, list) or not all(isinstance(path, str) for path in own):
        raise GymStartFailed(
            f"gym_global_config: config_paths must be a list of paths, not {own!r}"
        )
    if selection is None:
        paths.extend(own)
    else:
        chosen = _selected_paths(selection, package)
        if dropped := [path for path in own if path not in chosen]:
            log_event("gym_config_paths_replaced", by_selection=chosen, dropped=dropped)
        paths.extend(chosen)
    if paths:
        config["config_paths"] = list(dict.fromkeys(paths))
    head = config.get("head_server")
    if head is None:
        config["head_server"] = {"host": LOOPBACK, "port": head_port}
    elif not isinstance(head, Mapping):
        raise GymStartFailed(f"gym_global_config: head_server must be a mapping, not {head!r}")
    else:
        config["head_server"] = {"host": LOOPBACK, "port": head_port, **head}
    for key, variable in (("uv_cache_dir", "UV_CACHE_DIR"), ("uv_venv_dir", "NEMO_GYM_VENV_DIR")):
        if key not in config and environ.get(variable):
            config[key] = environ[variable]
    return config


def _selected_paths(selection: Any, package: EnvironmentPackage | None) -> list[str]:
    """The config paths the upstream orchestrator's component choice adds (see its docstring)."""
    if package is None:
        raise GymStartFailed(
            f"gym_global_config: {SELECTION_KEY} chooses components of an environment package, "
            "but there is none; set NMP_ENVIRONMENT_PATH"
        )
    if not isinstance(selection, Mapping):
        raise GymStartFailed(f"gym_global_config: {SELECTION_KEY} must be a mapping")
    for field in ("agent_instance", "resources_server_instance", "resources_server_config"):
        if not isinstance(selection.get(field), str) or not selection[field]:
            raise GymStartFailed(f"gym_global_config: {SELECTION_KEY}.{field} must be a name")
    if not isinstance(selection.get("model_config"), str) or not selection["model_config"]:
        raise GymStartFailed(f"gym_global_config: {SELECTION_KEY}.model_config must be a path")
    paths = []
    if selection["agent_instance"] not in package.agents:
        agent_config = selection.get("agent_config")
        if not isinstance(agent_config, str) or not agent_config:
            raise GymStartFailed(
                f"the environment package has no agent {selection['agent_instance']!r} and "
                f"{SELECTION_KEY}.agent_config names no built-in one"
            )
        paths.append(agent_config)
    paths.append(selection["model_config"])  # model configuration is the operator's, always
    if selection["resources_server_instance"] not in package.resources_servers:
        paths.append(selection["resources_server_config"])
    return paths


def check_ray_socket_paths(env: Mapping[str, str]) -> None:
    """Raise :class:`GymStartFailed`, naming the path and the limit, when the Ray that Gym would
    start in ``env`` could not bind its sockets: Gym would fail later, deep in Ray's start."""
    # Ray's own rule on Linux for where its sessions go: $RAY_TMPDIR/ray, $TMPDIR/ray, /tmp/ray.
    longest = os.path.join(env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp", RAY_SOCKET_EXAMPLE)
    if len(longest.encode()) > UNIX_SOCKET_PATH_LIMIT:
        raise GymStartFailed(
            f"Ray's socket paths would be up to {len(longest.encode())} bytes ({longest}), over "
            f"the {UNIX_SOCKET_PATH_LIMIT} bytes a Unix socket path may have: set RAY_TMPDIR "
            "(or TMPDIR) to a shorter directory for the host"
        )


def gym_environment(
    environ: Mapping[str, str],
    config: ServeConfig,
    package: EnvironmentPackage | None,
    *,
    python: str,
    tag: str,
) -> dict[str, str]:
    """The environment Gym runs in (see the module docstring)."""
    env = {name: value for name, value in environ.items() if name not in WITHHELD_VARIABLES}
    # As if Gym's environment were activated, as its users run it: its per-server builds ask uv
    # for the Gym Python's version, which uv then finds first (not, say, a pyenv shim of it) —
    # its base interpreter, for `uv venv` takes no venv's: wherever that is (an image's own
    # prefix, not on PATH), it follows.
    path = [
        str(Path(python).parent),
        *venv_home(python),
        *env.get("PATH", os.defpath).split(os.pathsep),
    ]
    env["PATH"] = os.pathsep.join(dict.fromkeys(entry for entry in path if entry))
    for variable, value in (
        ("NMP_DATASET_PATH", config.dataset_path),
        ("NMP_BROKER_URL", config.broker_url),
        ("NMP_BROKER_TOKEN", config.broker_token),
    ):
        if value:
            env[variable] = value
    if package is not None:
        roots = [str(package.root), *env.get("NEMO_GYM_EXTRA_ROOTS", "").split(os.pathsep)]
        env["NEMO_GYM_EXTRA_ROOTS"] = os.pathsep.join(dict.fromkeys(r for r in roots if r))
    if shutil.which("uv", path=env.get("PATH")) is None:
        # Gym builds each server's venv with `uv` from PATH; this host has one (a dependency).
        with contextlib.suppress(InstallError):
            env["PATH"] = os.pathsep.join([env["PATH"], str(Path(find_uv(env)).parent)])
    if "ray_head_node_address" not in (config.gym_global_config or {}):
        # Gym starts a Ray of its own: single-node, on loopback rather than on every interface
        # of the sandbox (Ray's switch for it is named after the platforms where it is the default).
        env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env["PYTHONUNBUFFERED"] = "1"  # Gym's output reaches the log (and a failure's tail) as printed
    env[DEPLOYMENT_VARIABLE] = tag
    return env


def index_unreachable(found: re.Match[str] | None, env: Mapping[str, str]) -> str:
    """The one line that says why a server's venv could not be built when uv could not reach
    an index (``found``: :data:`INDEX_UNREACHABLE`'s match), and which switch to turn; empty
    when that is not what happened. uv asks the index even with a wheelhouse on
    ``UV_FIND_LINKS``, unless it works offline."""
    if found is None or env.get("UV_OFFLINE", "").lower() in ("1", "true", "yes"):
        return ""
    said = (
        f"Gym could not build server {found['server']}'s venv: uv could not reach the package "
        f"index ({bounded(found['url'], 200)}) and works offline only when told to; "
    )
    if env.get("UV_FIND_LINKS"):
        return said + (
            "if the wheelhouse on UV_FIND_LINKS (the environment package's) is a complete "
            "closure, turn environment_offline on (NMP_ENVIRONMENT_OFFLINE=1, or "
            "environment_offline in the caller config); otherwise make the index reachable"
        )
    return said + (
        "make the index reachable, or give a wheelhouse that is a complete closure (a wheels-v1 "
        "package, or UV_FIND_LINKS) and turn environment_offline on (NMP_ENVIRONMENT_OFFLINE=1)"
    )


def venv_home(python: str) -> list[str]:
    """The directory of the interpreter the venv of ``python`` was made from (``home`` in its
    ``pyvenv.cfg``); none when ``python`` is not a venv's."""
    try:
        lines = (Path(python).parent.parent / "pyvenv.cfg").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "home" and value.strip():
            return [value.strip()]
    return []


def _hydra_quoted(path: str) -> str:
    escaped = path.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


def launch_argv(python: str, config_file: Path) -> list[str]:
    return [
        python,
        "-c",
        LAUNCHER,
        "env",
        "start",
        f"+config_paths=[{_hydra_quoted(str(config_file))}]",
    ]


def write_global_config(work: Path, config: Mapping[str, Any]) -> Path:
    """Write the config Gym starts from into its working directory; return the file."""
    work.mkdir(parents=True, exist_ok=True)
    config_file = work / GLOBAL_CONFIG_NAME
    config_file.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
    return config_file


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def head_endpoint(config: Mapping[str, Any]) -> Endpoint:
    """Where this host reaches the head server the config names (loopback for a wildcard)."""
    head = config["head_server"]
    host = str(head.get("host") or LOOPBACK)
    if host in ("0.0.0.0", "::", ""):
        host = LOOPBACK
    return Endpoint(host, int(head["port"]), "")


@attrs.frozen
class GymReady:
    """A deployment that is up: the head server's URL, for the ``agents`` machinery."""

    head_url: str


GymState = Literal["not_started", "starting", "up", "exited", "failed", "stopped"]
"""Where a deployment is: ``exited`` by itself once up, ``failed`` to come up, ``stopped`` by
the host."""


class GymDeployment:
    """One Gym deployment, owned by the task that runs :meth:`run`."""

    def __init__(
        self,
        config: ServeConfig,
        package: EnvironmentPackage | None,
        *,
        environ: MutableMapping[str, str] | None = None,
        opener: StreamOpener = open_tcp,
    ) -> None:
        self.config = config
        self.package = package
        self.environ = os.environ if environ is None else environ
        self.opener = opener
        self.limits: HttpLimits = config.http_limits()
        self.state: GymState = "not_started"
        self.tree: ProcessTree | None = None
        """The deployment's processes, while they run."""

    async def run(
        self, *, task_status: trio.TaskStatus[GymReady] = trio.TASK_STATUS_IGNORED
    ) -> str:
        """Start Gym, report it through ``task_status`` once it is up, and return — saying so —
        once it has exited by itself. Cancelled, it stops the whole deployment first.

        Raises :class:`GymStartFailed` (the deployment stopped) if it does not come up within
        ``gym_start_timeout_s`` or exits before.
        """
        python = gym_python(self.config.gym_python)
        await check_gym_python(python)
        if self.config.work_path:
            return await self._run_in(Path(self.config.work_path) / "gym", python, task_status)
        scratch = Path(
            tempfile.mkdtemp(prefix="trio-gym-gym-")
        )  # no work path: Gym's own, gone after
        try:
            return await self._run_in(scratch, python, task_status)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def _run_in(self, work: Path, python: str, task_status: trio.TaskStatus[GymReady]) -> str:
        config = gym_global_config(
            self.config.gym_global_config or {},
            self.package,
            head_port=free_loopback_port(),
            environ=self.environ,
        )
        config_file = write_global_config(work, config)
        head = head_endpoint(config)
        tag = secrets.token_hex(8)
        argv = launch_argv(python, config_file)
        env = gym_environment(self.environ, self.config, self.package, python=python, tag=tag)
        if "ray_head_node_address" not in config:  # Gym starts a Ray of its own
            check_ray_socket_paths(env)
        log_event("gym_starting", head_server=head.authority, work=str(work), deployment=tag)
        start = partial(
            run_process_tree,
            argv,
            name="gym",
            env=env,
            cwd=str(work),
            stop_grace_s=self.config.gym_stop_grace_s,
            remember=INDEX_UNREACHABLE,
        )
        failure: str | None = None
        self.state = "starting"
        try:
            async with trio.open_nursery() as nursery:
                try:
                    tree: ProcessTree = await nursery.start(start)
                except OSError as exc:
                    failure = f"cannot start Gym's guard: {exc}"
                else:
                    self.tree = tree
                    failure = await self._until_up(head, tree)
                    if failure is None:
                        log_event("gym_ready", head_server=head.authority, deployment=tag)
                        self.state = "up"
                        task_status.started(GymReady(f"http://{head.authority}"))
                        status = await tree.wait()
                        self.state = "exited"
                        output = tree.output.text()
                        return f"the Gym deployment exited with status {status}:\n{output}"
                    failure = f"{failure}{self._without_global_config()}\n{tree.output.text()}"
                    if cause := index_unreachable(tree.output.remembered, env):
                        failure = f"{cause}\n{failure}"
                    nursery.cancel_scope.cancel()  # stops the deployment
        finally:
            if self.state != "exited":
                self.state = "failed" if failure is not None else "stopped"
        raise GymStartFailed(failure)

    def _without_global_config(self) -> str:
        """A hint for the commonest cause of a Gym that will not start: the models and other
        shared servers the package's agents name live in the global config, and none was given."""
        if self.config.gym_global_config:
            return ""
        return (
            " (no Gym global config was given: the models the package's agents use are usually "
            "defined there; set NMP_GYM_GLOBAL_CONFIG, or gym_global_config in the caller config)"
        )

    async def _until_up(self, head: Endpoint, tree: ProcessTree) -> str | None:
        """``None`` once the deployment is up; else why it will not be (it exited first, or
        did not come up in time)."""
        failure: str | None = None

        async def note_exit(scope: trio.CancelScope) -> None:
            nonlocal failure
            status = await tree.wait()
            failure = f"Gym exited with status {status} before it was up"
            scope.cancel()

        async with trio.open_nursery() as race:
            race.start_soon(note_exit, race.cancel_scope)
            try:
                await wait_for_deployment(
                    head,
                    limits=self.limits,
                    opener=self.opener,
                    timeout_s=self.config.gym_start_timeout_s,
                    probe_servers=True,
                )
            except AgentError as exc:
                failure = str(exc)
            race.cancel_scope.cancel()
        return failure
