"""Environment packages: ``nemo-environment.yaml`` and what it points at, validated strictly.

A package is a directory holding the manifest::

    format: wheels-v1            # or native-v1
    config_paths: [...]          # relative POSIX paths to Gym YAML configs
    metadata: {name: ..., description: ...}

``native-v1`` ships server trees (configs under ``responses_api_agents/`` or
``resources_servers/``) whose dependencies come from an index; ``wheels-v1`` ships a flat,
non-empty ``wheels/`` directory of ``.whl`` files. Validation reads files only — YAML and file
names — and never imports anything from the package. Every problem found is reported, each
naming the file and the rule.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Final, Literal

import attrs
import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field

from trio_gym.config import yaml_problem
from trio_gym.errors import validation_problems

MANIFEST: Final = "nemo-environment.yaml"
WHEELS_DIR: Final = "wheels"
NATIVE_ROOTS: Final = ("responses_api_agents/", "resources_servers/")
AGENT_KEY: Final = "responses_api_agents"
RESOURCES_KEY: Final = "resources_servers"
MODEL_KEY: Final = "responses_api_models"

# A wheel file name: {distribution}-{version}(-{build tag})?-{python}-{abi}-{platform}.whl
_WHEEL_NAME: Final = re.compile(
    r"(?P<dist>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl", re.IGNORECASE
)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: Annotated[str, Field(min_length=1, max_length=255)]
    description: str | None = None


class NativeManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal["native-v1"]
    config_paths: Annotated[list[str], Field(min_length=1)]
    metadata: Metadata


class WheelsManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal["wheels-v1"]
    config_paths: list[str]
    metadata: Metadata


FORMATS: Final[dict[str, type[NativeManifest | WheelsManifest]]] = {
    "native-v1": NativeManifest,
    "wheels-v1": WheelsManifest,
}


class PackageError(Exception):
    """The package cannot be used; ``problems`` lists every ``file: rule`` found."""

    def __init__(self, root: Path, problems: list[str]) -> None:
        super().__init__(f"{root}: " + "; ".join(problems))
        self.root = root
        self.problems = problems


@attrs.frozen
class Wheel:
    path: Path
    distribution: str
    """Normalised as packaging does: lower case, runs of ``-_.`` as one ``-``."""
    version: str


@attrs.frozen
class EnvironmentPackage:
    """A validated package: what the installer and ``trio-gym validate`` work from."""

    root: Path
    format: str
    name: str
    description: str | None
    config_paths: tuple[str, ...]
    agents: tuple[str, ...]
    resources_servers: tuple[str, ...]
    wheels: tuple[Wheel, ...]

    @property
    def wheel_dir(self) -> Path:
        return self.root / WHEELS_DIR

    def summary(self) -> str:
        lines = [
            f"{self.name} ({self.format}) at {self.root}",
            f"  configs: {len(self.config_paths)}",
            f"  agents: {', '.join(self.agents) or '-'}",
            f"  resources servers: {', '.join(self.resources_servers) or '-'}",
        ]
        if self.format == "wheels-v1":
            wheels = ", ".join(f"{w.distribution}=={w.version}" for w in self.wheels)
            lines.append(f"  wheels: {len(self.wheels)} ({wheels})")
        if self.description:
            lines.insert(1, f"  {self.description}")
        return "\n".join(lines)


def normalise_distribution(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def has_manifest(root: Path) -> bool:
    return (root / MANIFEST).is_file() or (root / MANIFEST).is_symlink()


def load_package(root: Path) -> EnvironmentPackage:
    """Validate the package at ``root``; raises :class:`PackageError` listing every problem."""
    problems: list[str] = []
    manifest = _load_manifest(root, problems)
    if root.is_dir():
        _check_tree(root, problems)
    if manifest is None:
        raise PackageError(root, problems)
    configs = _check_config_paths(root, manifest, problems)
    agents, resources = _inspect_components(root, configs, problems)
    wheels = _check_wheels(root, problems) if manifest.format == "wheels-v1" else []
    if problems:
        raise PackageError(root, problems)
    return EnvironmentPackage(
        root=root,
        format=manifest.format,
        name=manifest.metadata.name,
        description=manifest.metadata.description,
        config_paths=tuple(manifest.config_paths),
        agents=tuple(agents),
        resources_servers=tuple(resources),
        wheels=tuple(wheels),
    )


def _load_manifest(root: Path, problems: list[str]) -> NativeManifest | WheelsManifest | None:
    path = root / MANIFEST
    if not root.is_dir():
        problems.append(f"{root}: not a directory")
        return None
    if path.is_symlink():
        problems.append(f"{MANIFEST}: is a symlink; ship the file itself")
        return None
    if not path.is_file():
        problems.append(f"{MANIFEST}: missing; every environment package starts with one")
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        problems.append(f"{MANIFEST}{yaml_problem(exc)}")
        return None
    except UnicodeDecodeError as exc:
        problems.append(f"{MANIFEST}: not UTF-8 (byte {exc.start})")
        return None
    if not isinstance(data, dict):
        problems.append(f"{MANIFEST}: must be a mapping of format, config_paths and metadata")
        return None
    model = FORMATS.get(data.get("format"))  # type: ignore[arg-type]
    if model is None:
        known = ", ".join(FORMATS)
        problems.append(f"{MANIFEST}: format: must be one of {known}, not {data.get('format')!r}")
        return None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        problems.extend(f"{MANIFEST}: {problem}" for problem in validation_problems(exc))
        return None


def _walk(root: Path) -> Iterator[Path]:
    """Every entry under ``root``, never following a symlink."""
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames) + sorted(filenames):
            yield Path(directory) / name


def _check_tree(root: Path, problems: list[str]) -> None:
    for path in _walk(root):
        relative = path.relative_to(root).as_posix()
        if relative == MANIFEST:
            continue  # the manifest's own problems are _load_manifest's
        if path.is_symlink():
            problems.append(f"{relative}: is a symlink; packages ship real files only")
        elif path.suffix == ".jsonl":
            problems.append(
                f"{relative}: JSONL data does not belong in an environment package; "
                "ship it as a separate dataset"
            )


def _unsafe_path_reason(text: str) -> str | None:
    if not text or text != text.strip():
        return "empty or padded with whitespace"
    if "\\" in text:
        return "contains a backslash; use POSIX '/' separators"
    posix = PurePosixPath(text)
    if posix.is_absolute():
        return "absolute; paths are relative to the package"
    if text in (".", "./") or ".." in posix.parts:
        return "escapes or names the package root"
    return None


def _check_config_paths(
    root: Path, manifest: NativeManifest | WheelsManifest, problems: list[str]
) -> list[str]:
    valid: list[str] = []
    seen: set[str] = set()
    for text in manifest.config_paths:
        reason = _unsafe_path_reason(text)
        normal = PurePosixPath(text).as_posix() if reason is None else text
        if reason is None and normal in seen:
            reason = "listed twice"
        if (
            reason is None
            and manifest.format == "native-v1"
            and not normal.startswith(NATIVE_ROOTS)
        ):
            reason = f"native-v1 configs live under {' or '.join(NATIVE_ROOTS)}"
        path = root / normal
        if reason is None and normal.startswith(f"{MODEL_KEY}/"):
            reason = "model configuration is operator-owned; do not ship one"
        if reason is None and not path.is_file():
            reason = "no such file"
        if reason is None and not path.resolve().is_relative_to(root.resolve()):
            reason = "resolves outside the package"
        if reason is not None:
            problems.append(f"config_paths: {text!r}: {reason}")
            continue
        seen.add(normal)
        valid.append(normal)
    return valid


def _inspect_components(
    root: Path, configs: list[str], problems: list[str]
) -> tuple[list[str], list[str]]:
    """Agent and resources-server instance names, read from the YAML alone."""
    agents: dict[str, str] = {}
    resources: dict[str, str] = {}
    for relative in configs:
        try:
            data: Any = yaml.safe_load((root / relative).read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            problems.append(f"{relative}{yaml_problem(exc)}")
            continue
        except UnicodeDecodeError as exc:
            problems.append(f"{relative}: not UTF-8 (byte {exc.start})")
            continue
        if not isinstance(data, dict):
            problems.append(f"{relative}: a Gym config must be a mapping of server instances")
            continue
        for instance, body in data.items():
            kinds = set(body) if isinstance(body, dict) else set()
            if MODEL_KEY in kinds:
                problems.append(
                    f"{relative}: {instance}: model configuration is operator-owned; "
                    "remove the responses_api_models server"
                )
            for kind, found, other in (
                (AGENT_KEY, agents, resources),
                (RESOURCES_KEY, resources, agents),
            ):
                if kind not in kinds:
                    continue
                if instance in found:
                    problems.append(
                        f"{relative}: {instance}: name already defined in {found[instance]}"
                    )
                elif instance in other:
                    problems.append(
                        f"{relative}: {instance}: one name used for both an agent and a "
                        f"resources server (also in {other[instance]})"
                    )
                else:
                    found[instance] = relative
    return sorted(agents), sorted(resources)


def _check_wheels(root: Path, problems: list[str]) -> list[Wheel]:
    directory = root / WHEELS_DIR
    if directory.is_symlink() or not directory.is_dir():
        problems.append(f"{WHEELS_DIR}/: wheels-v1 needs a real directory of .whl files")
        return []
    wheels: list[Wheel] = []
    versions: dict[str, Wheel] = {}
    for path in sorted(directory.iterdir()):
        relative = f"{WHEELS_DIR}/{path.name}"
        if path.is_symlink():
            continue  # reported by the tree walk
        if path.is_dir():
            problems.append(f"{relative}: nested directory; {WHEELS_DIR}/ must be flat")
            continue
        match = _WHEEL_NAME.fullmatch(path.name)
        if match is None:
            problems.append(f"{relative}: not a wheel; {WHEELS_DIR}/ holds .whl files only")
            continue
        wheel = Wheel(path, normalise_distribution(match["dist"]), match["version"])
        earlier = versions.get(wheel.distribution)
        if earlier is not None and earlier.version != wheel.version:
            problems.append(
                f"{relative}: a second version of {wheel.distribution} "
                f"({earlier.version} is in {earlier.path.name}); ship one"
            )
            continue
        versions[wheel.distribution] = wheel
        wheels.append(wheel)
    if not any(directory.iterdir()):
        problems.append(f"{WHEELS_DIR}/: empty; wheels-v1 ships at least one wheel")
    return wheels
