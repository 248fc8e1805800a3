"""The Docker provider's rules that need no daemon (the rest run against a real one in
``tests/test_platforms_real.py``)."""

from __future__ import annotations

import os

import pytest

from trio_gym.fleet import DockerProvider, HostSpec, LaunchFailed, Mount
from trio_gym.fleet.docker import _is_orphaned, _machine, _owner


async def test_without_a_docker_command_the_launch_fails_saying_so() -> None:
    provider = DockerProvider(image="any", docker="/nonexistent/docker")
    with pytest.raises(LaunchFailed, match="the Docker daemon cannot be used: cannot run"):
        async with provider.hosts(1, HostSpec()):
            pass


async def test_an_environment_value_with_a_line_break_is_refused_before_anything_runs() -> None:
    provider = DockerProvider(image="any", docker="/nonexistent/docker")
    with pytest.raises(ValueError, match=r"line break.*NMP_JOB_ID"):
        async with provider.hosts(1, HostSpec({"NMP_JOB_ID": "a\nb"})):
            pass


def test_only_this_machines_dead_trainers_own_orphans() -> None:
    assert not _is_orphaned(_owner())  # this very process
    machine = _machine()
    assert _is_orphaned(f"{machine}/999999999/1")  # no such process
    parent = os.getppid()
    assert _is_orphaned(f"{machine}/{parent}/0")  # a live pid, but another start time: reused
    assert not _is_orphaned(f"another-machine/{parent}/0")  # never judged here
    assert not _is_orphaned("not-a-label")
    assert not _is_orphaned(f"{machine}/999999999/None")  # no start time (no /proc): not judged


@pytest.mark.parametrize(
    ("source", "target"),
    [("relative/dir", "/in"), ("/a,readonly=false", "/in"), ("/a", "/in\nx"), ("/a", "")],
)
def test_a_mount_docker_cannot_carry_is_refused_naming_the_rule(source: str, target: str) -> None:
    with pytest.raises(ValueError, match="must be an absolute path without a comma"):
        Mount(source, target)
