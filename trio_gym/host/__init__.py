"""The sandbox host: routes, batches, heartbeats, admission."""

from trio_gym.host.server import ListenError, handle_connection, serve
from trio_gym.host.state import Host, HostStats

__all__ = ["Host", "HostStats", "ListenError", "handle_connection", "serve"]
