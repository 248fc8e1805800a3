"""The sandbox host: routes, batches, heartbeats, admission (DESIGN §3)."""

from trio_gym.host.server import handle_connection, serve
from trio_gym.host.state import Host, HostStats

__all__ = ["Host", "HostStats", "handle_connection", "serve"]
