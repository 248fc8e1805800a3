"""The installer stage: prepare the environment package before serving.

For ``wheels-v1`` every wheel is installed with uv into ``<work_path>/wheels-v1-site-packages``
with no index and binaries only. Then the process environment is pointed at the result, so the
host and every child it starts (Gym's per-server venv builds, a user's runner) find it:

- ``UV_FIND_LINKS`` names the wheelhouse, so a later ``uv pip install`` finds the wheels;
- ``PYTHONPATH`` and ``sys.path`` get the install directory first;
- ``UV_OFFLINE=1`` when the caller said ``environment_offline``: ``UV_FIND_LINKS`` only *adds*
  candidates, and with an index configured but unreachable, uv fails instead of falling back to
  the wheelhouse. Whether the wheelhouse is a complete closure is the caller's knowledge, never
  derived from the package format; an operator's own ``UV_OFFLINE`` always wins.

``native-v1`` ships server trees whose dependencies come from an index: nothing is installed,
and the offline choice still applies.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import MutableMapping, Sequence
from functools import partial
from pathlib import Path
from typing import Final

import trio

from trio_gym.config import ServeConfig
from trio_gym.logs import log_event
from trio_gym.processes import OutputTail

from .package import EnvironmentPackage, PackageError, has_manifest, load_package

SITE_PACKAGES: Final = "wheels-v1-site-packages"


class InstallError(Exception):
    """The stage failed; the message says what to fix."""


def find_uv(environ: MutableMapping[str, str]) -> str:
    """``uv`` on ``PATH``, else the binary of the ``uv`` Python package (a dependency)."""
    found = shutil.which("uv", path=environ.get("PATH"))
    if found is not None:
        return found
    try:
        import uv

        return str(uv.find_uv_bin())
    except (ImportError, FileNotFoundError) as exc:
        raise InstallError(
            "no uv binary: put uv on PATH or install the 'uv' package in this environment"
        ) from exc


async def install_environment(
    config: ServeConfig,
    *,
    environ: MutableMapping[str, str] | None = None,
    sys_path: list[str] | None = None,
) -> EnvironmentPackage | None:
    """Validate and prepare the package of ``config``; return it, or ``None`` when there is none.

    ``environ`` and ``sys_path`` (default: this process's) receive the changes described in the
    module docstring. Cancelling the stage kills uv. Raises :class:`InstallError` for a missing
    required package, an invalid package, or a failed, timed-out or missing uv.
    """
    environ = os.environ if environ is None else environ
    sys_path = sys.path if sys_path is None else sys_path
    package = await _find_package(config)
    if package is None:
        return None
    operator_offline = environ.get("UV_OFFLINE")
    if package.format == "wheels-v1":
        target = await _install_wheels(config, package, environ)
        _point_at(target, package.wheel_dir, environ, sys_path)
    if operator_offline is None and config.environment_offline:
        environ["UV_OFFLINE"] = "1"
    log_event(
        "environment_prepared",
        package=package.name,
        format=package.format,
        uv_offline=environ.get("UV_OFFLINE"),
        uv_offline_source="operator" if operator_offline is not None else "config",
        uv_find_links=environ.get("UV_FIND_LINKS"),
    )
    return package


async def _find_package(config: ServeConfig) -> EnvironmentPackage | None:
    required = config.environment_package_required
    if not config.environment_path:
        if required:
            raise InstallError(
                "an environment package is required (NMP_ENVIRONMENT_PACKAGE_REQUIRED) but no "
                "path was given; set NMP_ENVIRONMENT_PATH"
            )
        log_event("no_environment_package")
        return None
    return await trio.to_thread.run_sync(_open_package, Path(config.environment_path), required)


def _open_package(root: Path, required: bool) -> EnvironmentPackage | None:
    """The package at ``root`` (file reads only: runs in a worker thread)."""
    if not root.is_dir():  # a path that names nothing is a mistake, required or not
        raise InstallError(
            f"the environment path {root} is not a directory; check --environment-path "
            "(NMP_ENVIRONMENT_PATH) and that the package was copied into the sandbox"
        )
    if not has_manifest(root):
        if required:
            raise InstallError(
                f"no environment package at {root}: nemo-environment.yaml is missing; check "
                "--environment-path (NMP_ENVIRONMENT_PATH)"
            )
        log_event("no_environment_package", path=str(root))
        return None
    try:
        return load_package(root)
    except PackageError as exc:
        raise InstallError(f"invalid environment package: {exc}") from exc


async def _install_wheels(
    config: ServeConfig, package: EnvironmentPackage, environ: MutableMapping[str, str]
) -> Path:
    if not config.work_path:
        raise InstallError(
            "a wheels-v1 package needs a writable work path to install into; pass --work-path "
            "(NMP_WORK_PATH)"
        )
    target = Path(config.work_path) / SITE_PACKAGES
    target.mkdir(parents=True, exist_ok=True)
    argv = [
        find_uv(environ),
        "pip",
        "install",
        "--target",
        str(target),
        "--no-index",
        "--only-binary",
        ":all:",
        "--find-links",
        str(package.wheel_dir),
        "--python",
        sys.executable,
        *(str(wheel.path) for wheel in package.wheels),
    ]
    await run_logged(argv, env=dict(environ), timeout_s=config.install_timeout_s)
    return target


def _point_at(
    target: Path, wheel_dir: Path, environ: MutableMapping[str, str], sys_path: list[str]
) -> None:
    links = environ.get("UV_FIND_LINKS")
    environ["UV_FIND_LINKS"] = f"{wheel_dir},{links}" if links else str(wheel_dir)
    path = environ.get("PYTHONPATH")
    environ["PYTHONPATH"] = f"{target}{os.pathsep}{path}" if path else str(target)
    if str(target) in sys_path:
        sys_path.remove(str(target))
    sys_path.insert(0, str(target))
    importlib.invalidate_caches()


async def run_logged(argv: Sequence[str], *, env: dict[str, str], timeout_s: float) -> None:
    """Run ``argv``, logging each output line as it comes; raise :class:`InstallError` unless
    it exits 0 within ``timeout_s``. Cancelled (or timed out), the child is killed."""
    name = Path(argv[0]).name
    tail = OutputTail(name)
    log_event("process_started", argv=list(argv))
    try:
        with trio.move_on_after(timeout_s) as deadline:
            async with trio.open_nursery() as nursery:
                run = partial(
                    trio.run_process,
                    list(argv),
                    stdin=b"",
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    check=False,
                    env=env,
                )
                process: trio.Process = await nursery.start(run)
                assert process.stdout is not None and process.stderr is not None
                nursery.start_soon(tail.pump, "stdout", process.stdout)
                nursery.start_soon(tail.pump, "stderr", process.stderr)
    except OSError as exc:
        raise InstallError(f"could not run {argv[0]}: {exc}") from exc
    if deadline.cancelled_caught:
        raise InstallError(
            f"{name} did not finish within {timeout_s:g} s (install_timeout_s) and was stopped"
        )
    if process.returncode != 0:
        raise InstallError(f"{name} exited with status {process.returncode}:\n{tail.text()}")
