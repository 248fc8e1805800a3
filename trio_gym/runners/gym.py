"""The optional ``gym`` runner: NeMo Gym's own client, kept in an asyncio world of its own.

``nemo_gym`` is asyncio code (aiohttp, a global event loop); the host is trio. They never share
a thread: :class:`AsyncioThread` runs one asyncio event loop on a dedicated daemon thread, each
example's coroutine becomes a task there, and the trio side waits for it without blocking trio.
Cancelling the trio task (deadline, caller gone, shutdown) cancels the asyncio task, and the
trio side waits — bounded — until asyncio has finished cancelling it, so nothing Gym started is
left running behind a cancelled example.

``nemo_gym`` needs Python >= 3.13.14 and weighs about 1.5 GB; it is not a dependency. Without
it, ``--runner gym`` fails at start with a message that names ``--runner agents``, which speaks
the same ``/run`` protocol natively.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final, TypeVar

import trio

from trio_gym.http import Endpoint, HttpLimits
from trio_gym.runners.agents import agent_name, read_deployment, routes_of
from trio_gym.runners.base import ExampleContext

T = TypeVar("T")

# How long a cancelled example waits for its asyncio task to finish cancelling: Gym's handlers
# close their connections in `finally`; a task that ignores cancellation is abandoned after this.
CANCEL_GRACE_S: Final = 5.0


def gym_available() -> bool:
    return importlib.util.find_spec("nemo_gym") is not None


class AsyncioThread:
    """An asyncio event loop on a daemon thread of its own, for asyncio code called from trio."""

    def __init__(self, name: str = "trio-gym-asyncio") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``make()`` as a task on the asyncio loop; return its result or raise its error.

        A checkpoint. Cancelled, it cancels the asyncio task and waits up to ``CANCEL_GRACE_S``
        for the task to *finish* (its ``finally`` blocks included) before letting ``Cancelled``
        propagate.
        """
        finished = trio.Event()
        token = trio.lowlevel.current_trio_token()
        started: list[asyncio.Task[T]] = []
        failed: list[BaseException] = []

        def start() -> None:  # runs on the asyncio thread
            try:
                task = self._loop.create_task(make())
            except Exception as exc:  # make() itself raised: there is no task to wait for
                failed.append(exc)
                token.run_sync_soon(finished.set)
                return
            task.add_done_callback(lambda _: token.run_sync_soon(finished.set))
            started.append(task)

        def cancel() -> None:  # runs on the asyncio thread, after start()
            if started:
                started[0].cancel()

        self._loop.call_soon_threadsafe(start)
        try:
            await finished.wait()
        finally:
            if not finished.is_set():
                self._loop.call_soon_threadsafe(cancel)
                with trio.move_on_after(CANCEL_GRACE_S, shield=True):
                    await finished.wait()
        if failed:
            raise failed[0]
        return started[0].result()

    def close(self) -> None:
        """Stop the loop and wait for its thread (idempotent); unfinished tasks are dropped."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()


class GymRunner:
    """Runs each example through ``nemo_gym``'s ``ServerClient`` (``POST /run`` on its agent)."""

    def __init__(self, head_server: str, *, limits: HttpLimits | None = None) -> None:
        if not gym_available():
            raise RuntimeError(
                "the gym runner needs the nemo_gym package (Python >= 3.13.14; pip install "
                "nemo-gym); --runner agents speaks the same /run protocol without it"
            )
        self._head = Endpoint.parse(head_server)
        self._limits = limits or HttpLimits()
        self._asyncio = AsyncioThread()
        self._client: Any = None
        self._routes: dict[str, str] = {}

    async def start(self) -> None:
        """Read the deployment from the head server and build Gym's client for it."""
        deployment = await read_deployment(self._head, limits=self._limits)
        self._routes = {agent: server for agent, (server, _) in routes_of(deployment).items()}
        self._client = await self._asyncio.call(lambda: _gym_client(self._head, deployment))

    async def aclose(self) -> None:
        """Stop the asyncio thread (the host calls this when it stops)."""
        self._asyncio.close()

    def check_example(self, example: Mapping[str, Any]) -> None:
        agent_name(example)

    async def run_example(self, example: Mapping[str, Any], context: ExampleContext) -> Any:
        name = agent_name(example)
        server = self._routes.get(name, name)  # through its environment server, as Gym routes
        client = self._client
        return await self._asyncio.call(lambda: _gym_run(client, server, dict(example)))


async def _gym_client(head: Endpoint, deployment: Mapping[str, Any]) -> Any:
    """Gym's ``ServerClient`` for the deployment; built on the asyncio thread, where it lives."""
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from omegaconf import OmegaConf

    return ServerClient(
        head_server_config=BaseServerConfig(host=head.host, port=head.port),
        global_config_dict=OmegaConf.create(dict(deployment)),
    )


async def _gym_run(client: Any, agent: str, example: dict[str, Any]) -> Any:
    response = await client.post(server_name=agent, url_path="/run", json=example)
    response.raise_for_status()
    return await response.json()
