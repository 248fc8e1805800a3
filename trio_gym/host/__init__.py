"""The sandbox host: routes, batches, heartbeats, admission."""

from trio_gym.host.server import ListenError, handle_connection, serve
from trio_gym.host.state import Host, Services
from trio_gym.host.stats import HostStats

__all__ = ["Host", "HostStats", "ListenError", "Services", "handle_connection", "serve"]
