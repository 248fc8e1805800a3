"""The library a trio-based trainer imports to talk to hosts."""

from trio_gym.trainer.answers import decode_response
from trio_gym.trainer.client import RolloutClient
from trio_gym.trainer.coordinator import (
    CheckpointAborted,
    CheckpointCoordinator,
    CheckpointSettings,
    CheckpointUnavailable,
    Restored,
    RestoreFailed,
    RestoreRefused,
)
from trio_gym.trainer.dispatch import (
    Dispatcher,
    DispatchSettings,
    GroupFailed,
    SealedResult,
)
from trio_gym.trainer.errors import Origin, Reach, RolloutError
from trio_gym.trainer.host_client import ClientSettings, HostClient
from trio_gym.trainer.hosts import HostHandle, LaunchFailed
from trio_gym.trainer.pool import HostPool, Progress, SilentProgress
from trio_gym.trainer.scheduler import HostLost, RemoteHost, Scheduler, SchedulerSettings
from trio_gym.trainer.stream import Row, RowError, RowStream, StreamSummary

__all__ = [
    "CheckpointAborted",
    "CheckpointCoordinator",
    "CheckpointSettings",
    "CheckpointUnavailable",
    "ClientSettings",
    "DispatchSettings",
    "Dispatcher",
    "GroupFailed",
    "HostHandle",
    "HostClient",
    "HostLost",
    "HostPool",
    "LaunchFailed",
    "Origin",
    "Reach",
    "Progress",
    "RemoteHost",
    "RestoreFailed",
    "RestoreRefused",
    "Restored",
    "RolloutClient",
    "RolloutError",
    "Scheduler",
    "SchedulerSettings",
    "Row",
    "RowError",
    "RowStream",
    "SealedResult",
    "SilentProgress",
    "StreamSummary",
    "decode_response",
]
