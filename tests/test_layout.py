"""The rooms' boundaries, as a fresh interpreter sees them: importing one side loads nothing of
the other; the protocol both sides share loads neither."""

from __future__ import annotations

import subprocess
import sys

import pytest

TRAINER = (
    "trio_gym.trainer",
    "trio_gym.trainer.coordinator",
    "trio_gym.trainer.dispatch",
    "trio_gym.trainer.batch_file",
    "trio_gym.trainer.pool",
    "trio_gym.trainer.metrics",
    "trio_gym.trainer.status",
)
FLEET = (
    "trio_gym.fleet",
    "trio_gym.fleet.opensandbox",
    "trio_gym.fleet.ray_actor",
    "trio_gym.fleet.ray_hosts",
    "trio_gym.fleet.spread",
)
PROTOCOL = ("trio_gym.protocol.control", "trio_gym.protocol.export", "trio_gym.protocol.identity")


def loaded_by(modules: tuple[str, ...]) -> set[str]:
    """Every trio_gym module a fresh interpreter holds after importing ``modules``."""
    code = f"import sys, {', '.join(modules)}; print('\\n'.join(sys.modules))"
    listed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return {name for name in listed.split() if name.startswith("trio_gym")}


@pytest.mark.parametrize(
    ("modules", "never"),
    [
        (TRAINER, ("trio_gym.host", "trio_gym.runners", "trio_gym.install", "trio_gym.config")),
        (PROTOCOL, ("trio_gym.host", "trio_gym.trainer", "trio_gym.runners", "trio_gym.config")),
        (FLEET, ("trio_gym.host", "trio_gym.runners", "trio_gym.install")),
    ],
    ids=["trainer", "protocol", "fleet"],
)
def test_importing_one_side_loads_nothing_of_the_other(
    modules: tuple[str, ...], never: tuple[str, ...]
) -> None:
    loaded = loaded_by(modules)
    assert set(modules) <= loaded
    assert sorted(name for name in loaded if name.startswith(never)) == []
