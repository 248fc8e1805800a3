"""Live hosts for trainer tests: ``trio-gym serve`` subprocesses, each behind a stalling proxy."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import attrs
import trio

from tests.processes import LogReader, serve_process
from tests.stalling_proxy import StallingProxy
from trio_gym.trainer.control import HostControl

TOKEN = "coordinator-test-token"


@attrs.define
class LiveHost:
    name: str
    process: trio.Process
    port: int
    proxy: StallingProxy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def control(self) -> HostControl:
        return HostControl(self.url, TOKEN)


@asynccontextmanager
async def live_hosts(**runners: str) -> AsyncIterator[dict[str, LiveHost]]:
    """One ``trio-gym serve`` per name (``runner`` flag value per name), each behind a proxy."""
    async with AsyncExitStack() as stack:
        started = {}
        for name, runner in runners.items():
            process, logs, port = await stack.enter_async_context(
                serve_process(
                    "--heartbeat-interval",
                    "0.2",
                    "--runner",
                    runner,
                    env={"NMP_CONTROL_TOKEN": TOKEN},
                )
            )
            started[name] = (process, logs, port)
        async with trio.open_nursery() as proxies:  # inside: the hosts outlive their proxies
            hosts = {}
            for name, (process, logs, port) in started.items():
                proxies.start_soon(_keep_reading, logs)  # a full stderr pipe would stop the host
                proxy = StallingProxy(port)
                hosts[name] = LiveHost(name, process, await proxies.start(proxy.serve), proxy)
            yield hosts
            proxies.cancel_scope.cancel()


async def _keep_reading(logs: LogReader) -> None:
    while await logs.next_event() is not None:
        pass
