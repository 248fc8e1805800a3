"""Launching hosts for a trainer: providers (local processes, Docker containers, OpenSandbox
sandboxes, Ray).

Each provider launches hosts, waits until they are ready and stops them when its block ends;
:class:`~trio_gym.trainer.pool.HostPool` spreads work over them. See :mod:`.launch`.
"""

from trio_gym.fleet.docker import DockerProvider
from trio_gym.fleet.launch import HostSpec, Mount, Provider, wait_ready
from trio_gym.fleet.local import LocalProvider
from trio_gym.trainer.hosts import HostHandle, LaunchFailed

__all__ = [
    "DockerProvider",
    "HostHandle",
    "HostSpec",
    "LaunchFailed",
    "LocalProvider",
    "Mount",
    "Provider",
    "wait_ready",
]
