"""Every validation rule of the environment-package loader, each on a package built here."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.packages import (
    AGENT_CONFIG,
    RESOURCES_CONFIG,
    build_wheel,
    native_package,
    wheels_package,
    write_manifest,
)
from trio_gym.cli import main
from trio_gym.install import PackageError, load_package


def problems_of(root: Path) -> list[str]:
    with pytest.raises(PackageError) as refusal:
        load_package(root)
    return refusal.value.problems


def one_problem(root: Path) -> str:
    problems = problems_of(root)
    assert len(problems) == 1, problems
    return problems[0]


def edit_manifest(root: Path, **changes: object) -> None:
    manifest = yaml.safe_load((root / "nemo-environment.yaml").read_text())
    manifest.update(changes)
    (root / "nemo-environment.yaml").write_text(yaml.safe_dump(manifest))


def test_a_valid_wheels_package_loads(tmp_path: Path) -> None:
    package = load_package(wheels_package(tmp_path / "pkg"))
    assert (package.format, package.name) == ("wheels-v1", "tiny-env")
    assert [(w.distribution, w.version) for w in package.wheels] == [("tiny-env-dep", "1.0.0")]


def test_a_valid_native_package_loads_with_its_components(tmp_path: Path) -> None:
    package = load_package(native_package(tmp_path / "pkg"))
    assert package.agents == ("calendar_agent",)
    assert package.resources_servers == ("calendar_tools",)
    assert "a calendar assistant" in package.summary()


def test_validation_imports_nothing_from_the_package(tmp_path: Path) -> None:
    root = wheels_package(tmp_path / "pkg")
    marker = tmp_path / "imported"
    (root / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (root / "__init__.py").write_text("import evil\n")
    load_package(root)
    assert not marker.exists()
    assert "evil" not in sys.modules


def test_missing_manifest(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    assert "nemo-environment.yaml: missing" in one_problem(tmp_path / "pkg")


def test_manifest_that_is_a_symlink(tmp_path: Path) -> None:
    real = wheels_package(tmp_path / "real")
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "nemo-environment.yaml").symlink_to(real / "nemo-environment.yaml")
    assert "nemo-environment.yaml: is a symlink" in one_problem(root)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"extra": 1}, "unknown key 'extra'"),
        ({"format": "wheels-v2"}, "format"),
        ({"metadata": {"name": ""}}, "metadata.name"),
        ({"metadata": {"name": "x" * 256}}, "metadata.name"),
        ({"metadata": {"name": "ok", "version": "1"}}, "metadata.version"),
        ({"config_paths": "configs/a.yaml"}, "config_paths"),
    ],
)
def test_manifest_keys_are_strict(tmp_path: Path, change: dict[str, object], fragment: str) -> None:
    root = wheels_package(tmp_path / "pkg")
    edit_manifest(root, **change)
    problem = one_problem(root)
    assert problem.startswith("nemo-environment.yaml: ") and fragment in problem


def test_metadata_name_of_255_characters_is_fine(tmp_path: Path) -> None:
    root = wheels_package(tmp_path / "pkg")
    edit_manifest(root, metadata={"name": "x" * 255})
    load_package(root)


def test_native_packages_need_a_config(tmp_path: Path) -> None:
    root = native_package(tmp_path / "pkg")
    edit_manifest(root, config_paths=[])
    assert "config_paths" in one_problem(root)


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/etc/passwd", "absolute"),
        ("responses_api_agents/../../x.yaml", "escapes"),
        ("responses_api_agents\\calendar.yaml", "backslash"),
        (" responses_api_agents/calendar/configs/agent.yaml", "whitespace"),
        ("", "empty"),
        (".", "escapes or names the package root"),
        ("configs/agent.yaml", "native-v1 configs live under"),
        ("responses_api_agents/none.yaml", "no such file"),
    ],
)
def test_unsafe_or_wrong_config_paths(tmp_path: Path, path: str, reason: str) -> None:
    root = native_package(tmp_path / "pkg")
    edit_manifest(root, config_paths=[path, "resources_servers/calendar/configs/tools.yaml"])
    problem = one_problem(root)
    assert problem.startswith(f"config_paths: {path!r}: ") and reason in problem


def test_duplicate_config_paths(tmp_path: Path) -> None:
    root = native_package(tmp_path / "pkg")
    path = "resources_servers/calendar/configs/tools.yaml"
    edit_manifest(root, config_paths=[path, path])
    assert "listed twice" in one_problem(root)


def test_model_configs_are_operator_owned(tmp_path: Path) -> None:
    root = native_package(tmp_path / "pkg")
    models = root / "resources_servers/calendar/configs/tools.yaml"
    models.write_text(
        yaml.safe_dump({**RESOURCES_CONFIG, "my_model": {"responses_api_models": {}}})
    )
    problem = one_problem(root)
    assert "my_model" in problem and "operator-owned" in problem


def test_symlinked_config_is_refused_even_inside_the_package(tmp_path: Path) -> None:
    root = native_package(tmp_path / "pkg")
    agent = root / "responses_api_agents/calendar/configs/agent.yaml"
    real = agent.with_name("real.yaml")
    agent.rename(real)
    agent.symlink_to(real)
    assert "agent.yaml: is a symlink" in one_problem(root)


def test_jsonl_anywhere_is_refused(tmp_path: Path) -> None:
    root = native_package(tmp_path / "pkg")
    (root / "resources_servers/calendar/data").mkdir()
    (root / "resources_servers/calendar/data/train.jsonl").write_text("{}\n")
    problem = one_problem(root)
    assert problem.startswith("resources_servers/calendar/data/train.jsonl: JSONL")


def test_duplicate_instance_names_across_configs(tmp_path: Path) -> None:
    root = native_package(tmp_path / "pkg")
    second = root / "responses_api_agents/other/configs/agent.yaml"
    second.parent.mkdir(parents=True)
    second.write_text(yaml.safe_dump(AGENT_CONFIG))
    edit_manifest(
        root,
        config_paths=[
            "responses_api_agents/calendar/configs/agent.yaml",
            "responses_api_agents/other/configs/agent.yaml",
        ],
    )
    assert "calendar_agent: name already defined in" in one_problem(root)


def test_one_name_for_an_agent_and_a_resources_server(tmp_path: Path) -> None:
    root = native_package(tmp_path / "pkg")
    tools = root / "resources_servers/calendar/configs/tools.yaml"
    tools.write_text(yaml.safe_dump({"calendar_agent": RESOURCES_CONFIG["calendar_tools"]}))
    assert "both an agent and a resources server" in one_problem(root)


def test_a_config_that_is_not_a_mapping(tmp_path: Path) -> None:
    root = native_package(tmp_path / "pkg")
    (root / "resources_servers/calendar/configs/tools.yaml").write_text("- a\n- b\n")
    assert "must be a mapping" in one_problem(root)


def _without_wheels_dir(root: Path) -> None:
    for wheel in (root / "wheels").iterdir():
        wheel.unlink()
    (root / "wheels").rmdir()


def _symlinked_wheels_dir(root: Path) -> None:
    (root / "wheels").rename(root.parent / "elsewhere")
    (root / "wheels").symlink_to(root.parent / "elsewhere")


def _empty_wheels_dir(root: Path) -> None:
    for wheel in (root / "wheels").iterdir():
        wheel.unlink()


def _nested_dir(root: Path) -> None:
    (root / "wheels" / "more").mkdir()


def _non_wheel(root: Path) -> None:
    (root / "wheels" / "notes.txt").write_text("hi")


def _symlinked_wheel(root: Path) -> None:
    wheel = next((root / "wheels").iterdir())
    moved = root / wheel.name
    wheel.rename(moved)
    wheel.symlink_to(moved)


def _two_versions(root: Path) -> None:
    build_wheel(root / "wheels", "Tiny_Env.Dep", "2.0.0", {"tiny_env_dep/__init__.py": ""})


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (_without_wheels_dir, "wheels/: wheels-v1 needs a real directory"),
        (_symlinked_wheels_dir, "wheels: is a symlink"),
        (_empty_wheels_dir, "wheels/: empty"),
        (_nested_dir, "wheels/more: nested directory"),
        (_non_wheel, "wheels/notes.txt: not a wheel"),
        (_symlinked_wheel, "is a symlink"),
        (_two_versions, "a second version of tiny-env-dep"),
    ],
)
def test_the_wheelhouse_rules(
    tmp_path: Path, damage: Callable[[Path], None], fragment: str
) -> None:
    root = wheels_package(tmp_path / "pkg")
    damage(root)
    assert any(fragment in problem for problem in problems_of(root)), problems_of(root)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    root = native_package(tmp_path / "pkg")
    (root / "x.jsonl").write_text("")
    edit_manifest(root, config_paths=["/abs.yaml", "configs/a.yaml"])
    assert len(problems_of(root)) == 3


def test_validate_command_prints_a_summary_or_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = wheels_package(tmp_path / "good")
    assert main(["validate", str(good)]) == 0
    assert "tiny-env (wheels-v1)" in capsys.readouterr().out
    bad = native_package(tmp_path / "bad")
    (bad / "a.jsonl").write_text("")
    os.symlink(bad / "a.jsonl", bad / "b.jsonl")
    assert main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "2 problem(s)" in out and "a.jsonl" in out and "b.jsonl: is a symlink" in out


def test_write_manifest_helper_round_trips(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"format": "native-v1"})
    assert yaml.safe_load((tmp_path / "nemo-environment.yaml").read_text()) == {
        "format": "native-v1"
    }


def test_a_bad_manifest_still_gets_every_problem_listed(tmp_path: Path) -> None:
    root = wheels_package(tmp_path / "pkg")
    edit_manifest(root, metadata={"name": ""}, extra=1)
    (root / "notes.jsonl").write_text("{}\n")
    problems = problems_of(root)
    assert len(problems) == 3, problems  # two manifest problems, one file problem
    assert any("metadata.name" in p for p in problems) and any("'extra'" in p for p in problems)
    assert any(p.startswith("notes.jsonl: JSONL") for p in problems)
