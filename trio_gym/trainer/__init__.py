"""The library a trio-based trainer imports to talk to hosts (DESIGN §5)."""

from trio_gym.trainer.client import (
    ClientSettings,
    Origin,
    Progress,
    RolloutClient,
    RolloutError,
    SilentProgress,
    decode_response,
)

__all__ = [
    "ClientSettings",
    "Origin",
    "Progress",
    "RolloutClient",
    "RolloutError",
    "SilentProgress",
    "decode_response",
]
