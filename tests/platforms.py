"""The real sandbox platforms the marked suites run on (``scripts/sandbox_platform.sh`` starts
them; ``.ci/run`` names the file it wrote in ``TRIO_GYM_PLATFORM_ENV``, read here and never
exported, so no other test's hosts inherit the server's key), and what the suites ask of them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest


def _platform() -> dict[str, str]:
    path = os.environ.get("TRIO_GYM_PLATFORM_ENV", "")
    if not path or not Path(path).is_file():
        return {}
    return dict(line.split("=", 1) for line in Path(path).read_text().splitlines() if "=" in line)


PLATFORM = _platform()
IMAGE = PLATFORM.get("TRIO_GYM_HOST_IMAGE", "")
DOCKER = PLATFORM.get("DOCKER_HOST", "")
OPENSANDBOX = PLATFORM.get("OPEN_SANDBOX_DOMAIN", "")
API_KEY = PLATFORM.get("OPEN_SANDBOX_API_KEY", "")
MOUNTS = PLATFORM.get("TRIO_GYM_PLATFORM_MOUNTS", "")
"""A directory of the machine that sandboxes may mount (the server admits it)."""

needs_docker = pytest.mark.skipif(
    not (IMAGE and DOCKER),
    reason="no real Docker daemon and host image: .ci/run starts them "
    "(scripts/sandbox_platform.sh start DIR; TRIO_GYM_PLATFORM_ENV=DIR/env)",
)
needs_opensandbox = pytest.mark.skipif(
    not (IMAGE and DOCKER and OPENSANDBOX),
    reason="no real opensandbox-server: .ci/run starts it (scripts/sandbox_platform.sh)",
)


def docker(*args: str) -> str:
    return subprocess.run(
        ["docker", "--host", DOCKER, *args], check=True, capture_output=True, text=True, timeout=60
    ).stdout


def containers(*filters: str) -> list[str]:
    arguments = [item for value in filters for item in ("--filter", value)]
    return docker("ps", "-aq", *arguments).split()


def opensandbox_provider(**settings: Any) -> Any:
    from trio_gym.fleet.opensandbox import OpenSandboxProvider

    return OpenSandboxProvider(
        image=IMAGE,
        entrypoint=["bash", "/opt/trio-gym/gym_host.sh", "/opt/venv/bin/python"],
        domain=OPENSANDBOX,
        api_key=API_KEY,
        poll_interval_s=0.3,
        **settings,
    )


def live_sandboxes() -> list[str]:
    from opensandbox.config import ConnectionConfigSync
    from opensandbox.models.sandboxes import SandboxFilter
    from opensandbox.sync import SandboxManagerSync

    manager = SandboxManagerSync.create(ConnectionConfigSync(domain=OPENSANDBOX, api_key=API_KEY))
    try:
        found = manager.list_sandbox_infos(SandboxFilter(states=["Pending", "Running"]))
        return [info.id for info in found.sandbox_infos]
    finally:
        manager.close()


def sandbox_containers() -> list[str]:
    return containers("label=opensandbox.io/id")
