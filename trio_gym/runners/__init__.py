"""Runners: what turns one example into one result."""

from trio_gym.runners.agents import AgentSettings, AgentsRunner
from trio_gym.runners.base import ExampleContext, Runner
from trio_gym.runners.deployment import AgentError
from trio_gym.runners.example import ExampleRunner
from trio_gym.runners.loading import RunnerLoadError, load_runner

__all__ = [
    "AgentError",
    "AgentSettings",
    "AgentsRunner",
    "ExampleContext",
    "ExampleRunner",
    "Runner",
    "RunnerLoadError",
    "load_runner",
]
