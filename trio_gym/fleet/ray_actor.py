"""An environment actor with NeMo RL's shape, over a pool of trio_gym hosts (``trio_gym[ray]``).

NeMo RL talks to its environment through a Ray actor: ``spinup``, ``health_check``,
``run_rollouts(rows)`` — a streaming generator of ``(row index, result, timing)`` in completion
order, consumed with ``num_returns="streaming"`` — and ``shutdown``. :class:`RolloutActor` is
that actor; :func:`remote_actor` makes its Ray class::

    actor = remote_actor().remote()
    ray.get(actor.spinup.remote({"hosts": 4}))
    for ref in actor.run_rollouts.options(num_returns="streaming").remote(rows):
        index, result, timing = ray.get(ref)

Inside, trio runs on a thread of its own (one *session*): the hosts (launched by a provider, or
given by URL) and a :class:`~trio_gym.trainer.pool.HostPool` over them live in its nursery, and
the actor's methods reach it with ``trio.from_thread``. Rules:

- **Cancellation is ours.** Ray's cancel does not interrupt a running ``trio.run``; it sets a
  flag. ``run_rollouts`` checks the flag while it waits for the next row, and a cancelled (or
  closed) generator cancels its batch: the requests in flight are cut, so the hosts cancel every
  running example. ``shutdown`` ends the session the same way, then stops the hosts.
- **Not restartable.** An actor runs one session; a second ``spinup`` is refused. Create it with
  ``max_restarts=0`` (the default of :func:`remote_actor`): a restarted actor would have lost its
  hosts' handles, not their processes. A killed actor takes its local hosts with it (their
  guards' lifelines are the actor's pipes).
- A row whose chunk failed is yielded with the :class:`~trio_gym.trainer.errors.RolloutError`
  as its result (it pickles whole): named, never dropped.
- The methods other than ``run_rollouts`` must be able to run while it streams: the actor is a
  threaded one (``max_concurrency`` > 1).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal

import attrs
import pydantic
import trio
from pydantic import BaseModel, ConfigDict, Field

from trio_gym.config import SECRET, CallerConfig
from trio_gym.errors import describe_validation_error, raise_unwrapped
from trio_gym.fleet.launch import HostSpec, Provider
from trio_gym.fleet.local import LocalProvider
from trio_gym.fleet.ray_hosts import RayProvider
from trio_gym.logs import log_event
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.hosts import HostHandle, Launcher
from trio_gym.trainer.pool import ChunkAnswered, HostPool
from trio_gym.trainer.scheduler import SchedulerSettings

CANCEL_POLL_S: Final = 0.1
"""How often a waiting ``run_rollouts`` looks at Ray's cancellation flag."""


class ActorConfig(BaseModel):
    """``spinup``'s argument. Frozen; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hosts: int = Field(default=1, ge=1, description="Hosts to launch (ignored with urls).")
    launch: Literal["local", "ray"] = Field(
        default="local",
        description="'local': child processes of the actor, on its node; 'ray': spread over "
        "the cluster's nodes by placement group.",
    )
    cpus_per_host: float = Field(default=1.0, gt=0, description="With launch 'ray'.")
    urls: list[str] = Field(
        default_factory=list, description="Hosts already running; none are launched then."
    )
    caller: CallerConfig | None = Field(
        default=None, description="The caller config launched hosts start from."
    )
    control_token: str = Field(default="", json_schema_extra=SECRET)
    chunk_size: int = Field(default=1, ge=1, description="Rows per request.")
    per_host_in_flight: int = Field(default=8, ge=1)
    ready_timeout_s: float = Field(default=600.0, gt=0)
    request_deadline_s: float = Field(default=1800.0 + 120.0, gt=0)


class SessionFailed(RuntimeError):
    """The session cannot answer: it never started, or it has ended; the message says why."""


@attrs.define
class _Ended:
    """Put in a row queue when its batch ends without every row: the reason."""

    why: BaseException


class Session:
    """trio on a thread of its own, holding the hosts and the pool; used from other threads."""

    def __init__(self, config: ActorConfig) -> None:
        self.config = config
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._descriptor: dict[str, Any] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._pool: HostPool | None = None
        self._rollouts: trio.Nursery | None = None
        self._stopping = threading.Event()
        """Set by :meth:`stop` first: a session still starting ends as soon as it is up."""
        self._thread = threading.Thread(target=self._run, name="trio-gym-session", daemon=True)

    @property
    def failure(self) -> BaseException | None:
        """What made :meth:`start` fail, if it did."""
        return self._failure

    def start(self) -> dict[str, Any]:
        """Launch the hosts and open the pool; what was launched. Raises what failed, and
        :class:`SessionFailed` if :meth:`stop` came first."""
        if self._stopping.is_set():
            raise SessionFailed("the actor was shut down before its spinup")
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure
        if self._stopping.is_set():
            self._thread.join()
            raise SessionFailed("the actor was shut down while it spun up; its hosts are stopped")
        return self._descriptor

    def healthy(self) -> bool:
        if not self._thread.is_alive() or self._token is None:
            return False
        assert self._pool is not None
        pool = self._pool
        try:
            return bool(trio.from_thread.run_sync(lambda: pool.hosts, trio_token=self._token))
        except trio.RunFinishedError:
            return False  # it ended meanwhile

    def rows_as_completed(
        self, rows: Sequence[Mapping[str, Any]], cancelled: Callable[[], bool]
    ) -> Iterator[tuple[int, Any, dict[str, Any]]]:
        """Every row's ``(index, result, timing)`` as its chunk is answered; ``cancelled``
        is asked while waiting (Ray's flag). Closing or cancelling this generator cuts the
        rows still running."""
        if not rows:
            return
        token = self._running_token()
        answered: queue.SimpleQueue[tuple[int, Any, dict[str, Any]] | _Ended] = queue.SimpleQueue()
        try:
            scope = trio.from_thread.run_sync(self._begin, list(rows), answered, trio_token=token)
        except trio.RunFinishedError:
            raise SessionFailed(
                "the session has ended (shutdown, or a failure it logged)"
            ) from None
        delivered = 0
        try:
            while delivered < len(rows):
                try:
                    item = answered.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    if cancelled():
                        return
                    continue
                if isinstance(item, _Ended):
                    raise SessionFailed(
                        f"the rollouts ended after {delivered} of {len(rows)} rows"
                    ) from item.why
                delivered += 1
                yield item
        finally:
            if delivered < len(rows):
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(scope.cancel, trio_token=token)

    def stop(self) -> None:
        """End the session: cancel every batch, stop the hosts, wait for the thread. A session
        still starting ends as soon as its hosts are up (a launch is not cut half-way)."""
        self._stopping.set()
        if self._token is not None and self._thread.is_alive():
            assert self._stop is not None
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        if self._thread.is_alive():
            self._thread.join()

    def _running_token(self) -> trio.lowlevel.TrioToken:
        if self._token is None or not self._thread.is_alive():
            raise SessionFailed("the session is not running: call spinup first (or it has ended)")
        return self._token

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            if self._started.is_set():
                log_event("session_failed", level=logging.ERROR, error=repr(exc))
                raise
            self._failure = exc  # raised by start(), in the caller's thread
            self._started.set()

    async def _main(self) -> None:
        try:
            await self._serve()
        except ExceptionGroup as group:
            raise_unwrapped(group)

    async def _serve(self) -> None:
        async with (
            self._hosts() as (handles, launcher),
            HostPool(
                handles,
                SchedulerSettings(per_host_in_flight=self.config.per_host_in_flight),
                client_settings=ClientSettings(
                    chunk_size=self.config.chunk_size,
                    request_deadline_s=self.config.request_deadline_s,
                ),
                launcher=launcher,
            ) as pool,
            trio.open_nursery() as rollouts,
        ):
            self._pool, self._rollouts, self._stop = pool, rollouts, trio.Event()
            self._descriptor = {"hosts": [{"name": h.name, "url": h.url} for h in handles]}
            self._token = trio.lowlevel.current_trio_token()
            self._started.set()
            if not self._stopping.is_set():  # stop() sets it before it looks for the token
                await self._stop.wait()
            rollouts.cancel_scope.cancel()

    @contextlib.asynccontextmanager
    async def _hosts(self) -> AsyncIterator[tuple[list[HostHandle], Launcher | None]]:
        config = self.config
        if config.urls:
            yield [HostHandle(f"host-{i}", url) for i, url in enumerate(config.urls)], None
            return
        environment = config.caller.bootstrap_environment() if config.caller else {}
        spec = HostSpec(
            environment,
            control_token=config.control_token,
            ready_timeout_s=config.ready_timeout_s,
        )
        provider: Provider = (
            LocalProvider()
            if config.launch == "local"
            else RayProvider(cpus_per_host=config.cpus_per_host)
        )
        async with provider.hosts(config.hosts, spec) as handles:
            yield handles, provider

    def _begin(
        self,
        rows: list[Mapping[str, Any]],
        answered: queue.SimpleQueue[tuple[int, Any, dict[str, Any]] | _Ended],
    ) -> trio.CancelScope:
        """On the trio thread: start the batch in the session's nursery; its cancel scope."""
        assert self._rollouts is not None and self._pool is not None and self._stop is not None
        if self._stop.is_set():
            raise SessionFailed("the session is shutting down")
        scope = trio.CancelScope()
        self._rollouts.start_soon(self._feed, self._pool, rows, answered, scope)
        return scope

    async def _feed(
        self,
        pool: HostPool,
        rows: list[Mapping[str, Any]],
        answered: queue.SimpleQueue[tuple[int, Any, dict[str, Any]] | _Ended],
        scope: trio.CancelScope,
    ) -> None:
        def deliver(chunk: ChunkAnswered) -> None:
            timing = {"host": chunk.host, "elapsed_s": chunk.elapsed_s, "rows": len(chunk.outcomes)}
            for offset, outcome in enumerate(chunk.outcomes):
                answered.put((chunk.first + offset, outcome, timing))

        with scope:
            try:
                await pool.outcomes(rows, on_answer=deliver)
            except BaseException as exc:
                answered.put(_Ended(exc))
                raise


class RolloutActor:
    """NeMo RL's environment actor over trio_gym hosts (see the module docstring)."""

    def __init__(self) -> None:
        self._session: Session | None = None

    def spinup(self, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Launch the hosts (or take ``urls``) and open the pool; ``{"hosts": [...]}``."""
        if self._session is not None:
            if self._session.failure is not None:
                raise RuntimeError(
                    f"this actor's spinup failed ({self._session.failure}); an actor runs one "
                    "session: create another actor"
                )
            raise RuntimeError(
                "this actor has spun up already: it runs one session and is not restartable "
                "(a restarted actor would have lost its hosts); create another actor"
            )
        try:
            settings = ActorConfig.model_validate(config or {})
        except pydantic.ValidationError as exc:
            secrets = frozenset({"control_token"})
            raise ValueError(f"spinup: {describe_validation_error(exc, secrets=secrets)}") from None
        self._session = Session(settings)
        return self._session.start()

    def health_check(self) -> bool:
        return self._session is not None and self._session.healthy()

    def run_rollouts(
        self, rows: Sequence[Mapping[str, Any]]
    ) -> Iterator[tuple[int, Any, dict[str, Any]]]:
        """``(row index, result, timing)`` per row, in completion order (a streaming generator:
        ``.options(num_returns="streaming")``)."""
        if self._session is None:
            raise SessionFailed("call spinup first")
        yield from self._session.rows_as_completed(rows, _ray_cancelled)

    def shutdown(self) -> None:
        if self._session is not None:
            self._session.stop()


def _ray_cancelled() -> bool:
    import ray

    return bool(ray.get_runtime_context().is_canceled())


def remote_actor(**options: Any) -> Any:
    """The Ray actor class of :class:`RolloutActor`: threaded (``max_concurrency`` 8, so
    ``shutdown`` and ``health_check`` run while rows stream), never restarted."""
    import ray

    return ray.remote(**{"max_concurrency": 8, "max_restarts": 0, **options})(RolloutActor)
