"""trio_gym: a trio + h11 host for RL environments in sandboxes, and the client trainers use.

The names below are loaded when first used, so that importing one side — the trainer's
``trio_gym.trainer``, say — does not load the other (the host, its runners, Gym's launcher).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("trio-gym")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from trio_gym.config import ServeConfig, load_serve_config
    from trio_gym.errors import ErrorCode, WireError
    from trio_gym.host import Host, serve
    from trio_gym.runners import ExampleContext, Runner

_HOMES = {
    "ErrorCode": "trio_gym.errors",
    "ExampleContext": "trio_gym.runners",
    "Host": "trio_gym.host",
    "Runner": "trio_gym.runners",
    "ServeConfig": "trio_gym.config",
    "WireError": "trio_gym.errors",
    "load_serve_config": "trio_gym.config",
    "serve": "trio_gym.host",
}

__all__ = [
    "ErrorCode",
    "ExampleContext",
    "Host",
    "Runner",
    "ServeConfig",
    "WireError",
    "load_serve_config",
    "serve",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'trio_gym' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
