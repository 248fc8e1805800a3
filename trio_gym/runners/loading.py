"""Turning the ``runner`` setting into a runner object."""

from __future__ import annotations

import importlib

from trio_gym.config import ServeConfig
from trio_gym.runners.agents import AgentSettings, AgentsRunner
from trio_gym.runners.base import Runner
from trio_gym.runners.example import ExampleRunner


class RunnerLoadError(Exception):
    """The runner setting names nothing usable; the message says what and how to fix it."""


def load_runner(config: ServeConfig, *, gym_head_server: str = "") -> Runner:
    """The runner ``config.runner`` names: ``"example"``, ``"agents"`` (with ``config.agents``
    or ``config.head_server``), ``"gym"`` (the deployment the host started, reached through its
    head server ``gym_head_server`` as ``agents`` reaches any), or ``"package.module:factory"``
    where ``factory()`` returns one.

    Raises :class:`RunnerLoadError`. Importing runs the user's module, so this is the host's
    "starting runner" stage, reported on ``/health``, not something done while parsing config.
    """
    spec = config.runner
    if spec == "example":
        return ExampleRunner()
    if spec == "gym" and not gym_head_server:
        raise RunnerLoadError("runner 'gym': the host starts the Gym deployment first")
    if spec in ("agents", "gym"):
        settings = AgentSettings.from_config(config, head_server=gym_head_server or None)
        try:
            return AgentsRunner(settings, limits=config.http_limits())
        except ValueError as exc:
            raise RunnerLoadError(f"runner {spec!r}: {exc}") from exc
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise RunnerLoadError(
            f"runner {spec!r}: expected 'example', 'agents', 'gym' or 'package.module:factory'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RunnerLoadError(f"runner {spec!r}: cannot import {module_name!r}: {exc}") from exc
    try:
        factory = getattr(module, attribute)
    except AttributeError as exc:
        raise RunnerLoadError(
            f"runner {spec!r}: module {module_name!r} has no attribute {attribute!r}"
        ) from exc
    runner = factory()
    if not isinstance(runner, Runner):
        raise RunnerLoadError(
            f"runner {spec!r}: {attribute}() returned {type(runner).__name__}, which lacks "
            "check_example(example) and async run_example(example, context)"
        )
    return runner
