"""Building real wheels and environment packages inside tests (no network, no build backend)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path
from typing import Any

import yaml

RUNNER_MODULE = '''
import trio

from trio_gym.runners import ExampleRunner

from . import VERSION


class WheelRunner(ExampleRunner):
    """The example environment, stamped with the version of the wheel it came from."""

    async def run_example(self, example, context):
        result = await super().run_example(example, context)
        return {**result, "from_wheel": VERSION}


def factory():
    return WheelRunner()
'''


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def build_wheel(directory: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel per the wheel format: the files, METADATA, WHEEL and RECORD."""
    module = name.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    contents = {path: text.encode() for path, text in files.items()}
    contents[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    )
    contents[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: trio-gym-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(
        f"{path},{_record_hash(data)},{len(data)}\n" for path, data in contents.items()
    )
    contents[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in contents.items():
            archive.writestr(path, data)
    return wheel


def tiny_wheel(directory: Path, version: str = "1.0.0") -> Path:
    """``tiny-env-dep``: a module with a VERSION and a runner factory."""
    return build_wheel(
        directory,
        "tiny-env-dep",
        version,
        {
            "tiny_env_dep/__init__.py": f"VERSION = {version!r}\n",
            "tiny_env_dep/runner.py": RUNNER_MODULE,
        },
    )


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "nemo-environment.yaml").write_text(yaml.safe_dump(manifest))


AGENT_CONFIG = {
    "calendar_agent": {"responses_api_agents": {"simple_agent": {"entrypoint": "app.py"}}},
}
RESOURCES_CONFIG = {
    "calendar_tools": {"resources_servers": {"calendar": {"entrypoint": "app.py"}}},
}


def wheels_package(root: Path, *, version: str = "1.0.0") -> Path:
    """A valid wheels-v1 package holding the tiny wheel."""
    write_manifest(
        root,
        {"format": "wheels-v1", "config_paths": [], "metadata": {"name": "tiny-env"}},
    )
    tiny_wheel(root / "wheels", version)
    return root


def native_package(root: Path) -> Path:
    """A valid native-v1 package with one agent and one resources server."""
    write_manifest(
        root,
        {
            "format": "native-v1",
            "config_paths": [
                "responses_api_agents/calendar/configs/agent.yaml",
                "resources_servers/calendar/configs/tools.yaml",
            ],
            "metadata": {"name": "calendar-env", "description": "a calendar assistant"},
        },
    )
    for relative, config in (
        ("responses_api_agents/calendar/configs/agent.yaml", AGENT_CONFIG),
        ("resources_servers/calendar/configs/tools.yaml", RESOURCES_CONFIG),
    ):
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config))
    return root
