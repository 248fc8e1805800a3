"""trio_gym: a trio + h11 host for RL environments in sandboxes, and the client trainers use."""

from trio_gym.config import ServeConfig, load_serve_config
from trio_gym.errors import ErrorCode, WireError
from trio_gym.host import Host, serve
from trio_gym.runners import ExampleContext, Runner

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
