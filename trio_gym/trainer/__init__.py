"""The library a trio-based trainer imports to talk to hosts (DESIGN §5)."""

from trio_gym.trainer.client import ClientSettings, Progress, RolloutClient, SilentProgress
from trio_gym.trainer.errors import Origin, RolloutError, decode_response
from trio_gym.trainer.stream import Row, RowError, RowStream, StreamSummary

__all__ = [
    "ClientSettings",
    "Origin",
    "Progress",
    "RolloutClient",
    "RolloutError",
    "Row",
    "RowError",
    "RowStream",
    "SilentProgress",
    "StreamSummary",
    "decode_response",
]
