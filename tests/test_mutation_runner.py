"""scripts/mutations.py counts a mutation caught only when its named test failed — judged on
what a real pytest run prints, not on any non-zero exit."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mutations.py"
CHECKS = textwrap.dedent(
    """
    import pytest

    def test_guarded_rule():
        assert 1 + 1 == 3

    def test_other_rule():
        assert True

    @pytest.mark.parametrize("n", [1, 2])
    def test_each(n):
        assert n == 1
    """
)


@pytest.fixture(scope="module")
def mutations() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutations", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_run(directory: Path, *ids: str) -> tuple[int, str]:
    """Run pytest as the mutation runner does, in a project of its own."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *ids],
        cwd=directory,
        capture_output=True,
        text=True,
        check=False,
    )
    return result.returncode, result.stdout


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "test_checks.py").write_text(CHECKS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # a project of its own: none of ours
    return tmp_path


@pytest.mark.parametrize(
    ("ids", "caught", "why"),
    [
        (["test_checks.py::test_guarded_rule"], True, "1 of 1 named"),
        (["test_checks.py::test_each"], True, "1 of 1 named"),  # one parameter failed
        (["test_checks.py::test_renamed_rule"], False, "exited 4"),
        (["test_checks.py::test_other_rule"], False, "exited 0"),
        (["test_checks.py::test_other_rule", "test_checks.py::test_guarded_rule"], True, "1 of 2"),
    ],
    ids=["named-failed", "a-parameter-failed", "stale-id", "passed", "one-of-two"],
)
def test_a_mutation_is_caught_only_by_its_named_tests_failing(
    mutations: ModuleType, project: Path, ids: list[str], caught: bool, why: str
) -> None:
    returncode, output = pytest_run(project, *ids)
    judged = mutations.verdict(returncode, output, ids)
    assert judged.caught is caught and why in judged.why


def test_a_failure_of_another_test_or_a_broken_file_or_a_hang_is_no_catch(
    mutations: ModuleType, project: Path
) -> None:
    returncode, output = pytest_run(project, "test_checks.py")  # test_other_rule is named
    other = mutations.verdict(returncode, output, ["test_checks.py::test_other_rule"])
    assert returncode == 1 and not other.caught and "none of the named tests" in other.why
    (project / "test_checks.py").write_text("def test_guarded_rule(:\n")
    returncode, output = pytest_run(project, "test_checks.py::test_guarded_rule")
    broken = mutations.verdict(returncode, output, ["test_checks.py::test_guarded_rule"])
    assert not broken.caught and "not 1" in broken.why
    assert not mutations.verdict(None, "", ["test_checks.py::test_guarded_rule"]).caught
