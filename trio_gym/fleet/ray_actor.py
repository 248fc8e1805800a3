"""An environment actor with NeMo RL's shape, over trio_gym hosts (``trio_gym[ray]``).

NeMo RL talks to its environment through a Ray actor: ``spinup``, ``health_check``,
``run_rollouts(rows)`` — a streaming generator of ``(row index, result, timing)`` in completion
order, consumed with ``num_returns="streaming"`` — and ``shutdown``. :class:`RolloutActor` is
that actor, plus ``checkpoint(directory)`` and ``restore(directory)``; :func:`remote_actor`
makes its Ray class::

    actor = remote_actor().remote()
    ray.get(actor.spinup.remote({"hosts": 4}))
    for ref in actor.run_rollouts.options(num_returns="streaming").remote(rows):
        index, result, timing = ray.get(ref)

Inside, trio runs on a thread of its own (one *session*): the hosts (launched by a provider, or
given by URL) and a checkpointing :class:`~trio_gym.trainer.dispatch.Dispatcher` over them (the
one scheduler: lost hosts replaced, their episodes recovered) live in its nursery, and the
actor's methods reach it with ``trio.from_thread``. Each call's rows run as groups of
``chunk_size`` (one request per group and host). Rules:

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
- **Checkpoints.** ``checkpoint(directory)`` takes one consistent cut of the hosts and of what
  the actor has yielded (a row counts once it is yielded to the stream); the rows of the calls
  in flight are saved with it (the ledger keeps no payloads: the actor's state does). A new
  actor, spun up, ``restore(directory)``s it and gets those calls back; ``run_rollouts(rows,
  call_id=...)`` with a call's id then yields the rows it had not yielded — the episodes the
  checkpoint parked continue where they were, exactly once. Launched hosts get a control token
  of the actor's own; hosts given by ``urls`` need ``control_token``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
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
from trio_gym.trainer.coordinator import CheckpointCoordinator, Restored
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.dispatch import Dispatcher, GroupFailed, SealedResult
from trio_gym.trainer.errors import Origin, Reach, RolloutError
from trio_gym.trainer.host_client import ClientSettings
from trio_gym.trainer.hosts import HostHandle, Launcher
from trio_gym.trainer.manifest import load_manifest
from trio_gym.trainer.scheduler import RemoteHost, SchedulerSettings

CANCEL_POLL_S: Final = 0.1
SAVED_ERROR: Final = "_trio_gym_row_error"
"""A row's error as a checkpoint saves it (the key marks it as not a result)."""
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
    chunk_size: int = Field(default=1, ge=1, description="Rows per group (per request).")
    per_host_in_flight: int = Field(default=8, ge=1)
    ready_timeout_s: float = Field(default=600.0, gt=0)
    request_deadline_s: float = Field(default=1800.0 + 120.0, gt=0)


class SessionFailed(RuntimeError):
    """The session cannot answer: it never started, or it has ended; the message says why."""


@attrs.define
class _Ended:
    """Put in a row queue when its batch ends without every row: the reason."""

    why: BaseException


Answered = tuple[int, Any, dict[str, Any]]


@attrs.define(eq=False)
class _Call:
    """One ``run_rollouts`` call's rows: those yielded (``delivered``, by the generator's
    thread) and those with an outcome not yielded yet (``ready``, by the trio thread's
    sealing; both kept under ``lock``, since a checkpoint saves them together)."""

    call_id: str
    rows: list[Any]
    chunk_size: int
    delivered: set[int] = attrs.field(factory=set)
    ready: dict[int, Answered] = attrs.field(factory=dict)
    started: float = 0.0
    answered: queue.SimpleQueue[Answered | _Ended] = attrs.field(factory=queue.SimpleQueue)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def answer(self, item: Answered) -> None:
        with self.lock:
            self.ready[item[0]] = item
        self.answered.put(item)

    def yielded(self, index: int) -> None:
        with self.lock:
            self.ready.pop(index, None)
            self.delivered.add(index)

    def answered_or_delivered(self, index: int) -> bool:
        with self.lock:
            return index in self.ready or index in self.delivered

    def groups(self) -> dict[str, list[Any]]:
        size = self.chunk_size
        return {
            f"{self.call_id}/{first // size}": self.rows[first : first + size]
            for first in range(0, len(self.rows), size)
        }

    def index(self, group_id: str, sibling: int) -> int:
        return int(group_id.rsplit("/", 1)[1]) * self.chunk_size + sibling

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps of the call: a row whose outcome is in but not yet yielded
        is saved with it, and yielded first by the call's continuation."""
        with self.lock:
            return {
                "rows": self.rows,
                "chunk_size": self.chunk_size,
                "delivered": sorted(self.delivered),
                "ready": [[i, _saved_outcome(o), t] for i, o, t in self.ready.values()],
            }

    @classmethod
    def restored(cls, call_id: str, saved: Mapping[str, Any]) -> _Call:
        call = cls(call_id, saved["rows"], saved["chunk_size"], set(saved["delivered"]))
        for index, outcome, timing in saved["ready"]:
            call.answer((index, _outcome_of(outcome), timing))
        return call

    def groups_to_run(self) -> dict[str, list[Any]]:
        """The groups with a row that has no outcome yet."""
        return {
            group_id: rows
            for group_id, rows in self.groups().items()
            if any(
                not self.answered_or_delivered(self.index(group_id, 0) + i)
                for i in range(len(rows))
            )
        }


def _saved_outcome(outcome: Any) -> Any:
    if isinstance(outcome, RolloutError):
        return {SAVED_ERROR: outcome.message, "origin": outcome.origin.value, "code": outcome.code}
    return outcome


def _outcome_of(saved: Any) -> Any:
    if isinstance(saved, dict) and SAVED_ERROR in saved:
        return RolloutError(
            saved[SAVED_ERROR],
            origin=Origin(saved["origin"]),
            reach=Reach.TAKEN,
            code=saved["code"],
        )
    return saved


class Session:
    """trio on a thread of its own, holding the hosts and the pool; used from other threads."""

    def __init__(self, config: ActorConfig) -> None:
        self.config = config
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._descriptor: dict[str, Any] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._dispatcher: Dispatcher | None = None
        self._coordinator: CheckpointCoordinator | None = None
        self._rollouts: trio.Nursery | None = None
        self._calls: dict[str, _Call] = {}
        self._restored: dict[str, _Call] = {}
        """Calls a restore brought back, until ``run_rollouts`` continues each."""
        self._next_call = 0
        self._prefix = secrets.token_hex(4)
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
        assert self._dispatcher is not None
        dispatcher = self._dispatcher
        try:
            return bool(trio.from_thread.run_sync(lambda: dispatcher.hosts, trio_token=self._token))
        except trio.RunFinishedError:
            return False  # it ended meanwhile

    def rows_as_completed(
        self,
        rows: Sequence[Mapping[str, Any]] | None,
        cancelled: Callable[[], bool],
        call_id: str | None = None,
    ) -> Iterator[Answered]:
        """Every row's ``(index, result, timing)`` as it is sealed; ``cancelled`` is asked
        while waiting (Ray's flag). With ``call_id`` (a restored call), the rows it had not
        yielded. Closing or cancelling this generator gives the rows still running up."""
        token = self._running_token()
        try:
            call, scope = trio.from_thread.run_sync(
                self._begin, None if rows is None else list(rows), call_id, trio_token=token
            )
        except trio.RunFinishedError:
            raise SessionFailed(
                "the session has ended (shutdown, or a failure it logged)"
            ) from None
        with call.lock:
            expected = len(call.rows) - len(call.delivered)
        delivered = 0
        try:
            while delivered < expected:
                try:
                    item = call.answered.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    if cancelled():
                        return
                    continue
                if isinstance(item, _Ended):
                    raise SessionFailed(
                        f"the rollouts ended after {delivered} of {expected} rows"
                    ) from item.why
                delivered += 1
                yield item
                call.yielded(item[0])
        finally:
            if delivered < expected:
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(scope.cancel, trio_token=token)

    def checkpoint(self, directory: str) -> dict[str, Any]:
        """Take a checkpoint into ``directory``: its id, the episodes exported, the calls in
        flight. Raises the coordinator's :class:`CheckpointUnavailable` (try again later) or
        :class:`CheckpointAborted`."""
        coordinator = self._checkpointing()
        manifest = trio.from_thread.run(
            coordinator.checkpoint, Path(directory), trio_token=self._running_token()
        )
        return {
            "checkpoint_id": manifest.checkpoint_id,
            "exported": sum(len(host.episodes) for host in manifest.hosts),
            "calls": sorted(manifest.trainer_state["calls"]),
        }

    def restore(self, directory: str) -> dict[str, Any]:
        """Restore the checkpoint in ``directory`` into this fresh session; the calls it had in
        flight (``call_id``, its rows, the indices already yielded before the checkpoint)."""
        token = self._running_token()
        restored = trio.from_thread.run(self._restore, Path(directory), trio_token=token)
        return {
            "checkpoint_id": restored.checkpoint_id,
            "restored": len(restored.restored),
            "calls": [
                {"call_id": call.call_id, "rows": call.rows, "delivered": sorted(call.delivered)}
                for call in self._restored.values()
            ],
        }

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
        config = self.config
        async with self._hosts() as (handles, launcher):
            deadlines = DeadlineRegistry()
            connect = partial(
                RemoteHost.launched,
                settings=ClientSettings(request_deadline_s=config.request_deadline_s),
                deadlines=deadlines,
            )
            dispatcher = Dispatcher(
                [connect(handle) for handle in handles],
                self._sealed,
                deadlines=deadlines,
                scheduler=SchedulerSettings(per_host_in_flight=config.per_host_in_flight),
                launcher=launcher,
                connect=connect,
            )
            self._coordinator = CheckpointCoordinator(
                dispatcher,
                trainer_state=lambda: {  # restored calls not continued yet, and calls running
                    "calls": {
                        c.call_id: c.saved()
                        for c in [*self._restored.values(), *self._calls.values()]
                    }
                },
            )
            async with dispatcher, trio.open_nursery() as rollouts:
                self._dispatcher, self._rollouts, self._stop = dispatcher, rollouts, trio.Event()
                self._descriptor = {"hosts": [{"name": h.name, "url": h.url} for h in handles]}
                self._token = trio.lowlevel.current_trio_token()
                self._started.set()
                if not self._stopping.is_set():  # stop() sets it before it looks for the token
                    await self._stop.wait()
                rollouts.cancel_scope.cancel()

    @contextlib.asynccontextmanager
    async def _hosts(self) -> AsyncIterator[tuple[list[HostHandle], Launcher | None]]:
        config = self.config
        token = config.control_token
        if config.urls:
            yield (
                [
                    HostHandle(f"host-{i}", url, control_token=token)
                    for i, url in enumerate(config.urls)
                ],
                None,
            )
            return
        environment = config.caller.bootstrap_environment() if config.caller else {}
        spec = HostSpec(
            environment,
            control_token=token or secrets.token_hex(16),  # launched hosts: a token of its own
            ready_timeout_s=config.ready_timeout_s,
        )
        provider: Provider = (
            LocalProvider()
            if config.launch == "local"
            else RayProvider(cpus_per_host=config.cpus_per_host)
        )
        async with provider.hosts(config.hosts, spec) as handles:
            yield handles, provider

    def _checkpointing(self) -> CheckpointCoordinator:
        self._running_token()
        assert self._coordinator is not None
        if not self._descriptor or not all(
            host.handle.control_token for host in self._coordinator.dispatcher.hosts.values()
        ):
            raise SessionFailed(
                "checkpoints need the hosts' control plane: spin up with control_token for urls"
            )
        return self._coordinator

    async def _restore(self, directory: Path) -> Restored:
        assert self._coordinator is not None
        if self._calls or self._next_call:
            raise SessionFailed("restore into a session that has run nothing (spin up anew)")
        dispatcher = self._coordinator.dispatcher
        named = {host.instance for host in load_manifest(directory).hosts}
        live = set(dispatcher.hosts)
        successors = dict(zip(sorted(named - live), sorted(live - named), strict=False))
        restored = await self._coordinator.restore(directory, successors=successors)
        for call_id, saved in restored.trainer_state.get("calls", {}).items():
            self._restored[call_id] = _Call.restored(call_id, saved)
        return restored

    def _begin(
        self, rows: list[Mapping[str, Any]] | None, call_id: str | None
    ) -> tuple[_Call, trio.CancelScope]:
        """On the trio thread: start the call's groups in the session's nursery; the call and
        its cancel scope."""
        assert self._rollouts is not None and self._stop is not None
        if self._stop.is_set():
            raise SessionFailed("the session is shutting down")
        if call_id is not None:
            call = self._restored.pop(call_id, None)
            if call is None:
                raise SessionFailed(f"no restored call {call_id!r} is waiting to continue")
            if rows is not None and list(rows) != call.rows:
                raise SessionFailed(f"call {call_id!r} was checkpointed with other rows")
        else:
            if not rows:
                raise ValueError("run_rollouts needs at least one row")
            # The session's own prefix: a restored call's id never comes back as a new one.
            call_id = f"{self._prefix}-c{self._next_call}"
            call = _Call(call_id, list(rows), self.config.chunk_size)
            self._next_call += 1
        call.started = trio.current_time()
        self._calls[call.call_id] = call
        scope = trio.CancelScope()
        self._rollouts.start_soon(self._feed, call, scope)
        return call, scope

    def _sealed(self, sealed: SealedResult) -> None:
        """A row's outcome, in the ledger's mutation that seals it: yielded to its call."""
        call = self._calls[sealed.group_id.rsplit("/", 1)[0]]
        index = call.index(sealed.group_id, sealed.sibling)
        outcome: Any = sealed.result
        if sealed.error is not None:
            outcome = RolloutError(
                f"row {index}: {sealed.error.code}: {sealed.error.message}",
                origin=Origin.SANDBOX,
                reach=Reach.TAKEN,
                code=sealed.error.code,
            )
        timing = {
            "host": sealed.host,
            "elapsed_s": trio.current_time() - call.started,
            "attempt": sealed.attempt,
        }
        call.answer((index, outcome, timing))

    async def _feed(self, call: _Call, scope: trio.CancelScope) -> None:
        assert self._dispatcher is not None
        dispatcher = self._dispatcher

        async def one(group_id: str, rows: list[Any]) -> None:
            try:
                await dispatcher.run_group(group_id, rows)
            except GroupFailed as failure:  # its unsealed rows are yielded with why
                first = call.index(group_id, 0)
                cause = failure.cause
                for index in range(first, first + len(rows)):
                    if not call.answered_or_delivered(index):
                        error = RolloutError(
                            str(failure),
                            origin=cause.origin if cause else Origin.SANDBOX,
                            reach=Reach.TAKEN,
                            code=cause.code if cause else None,
                        )
                        call.answer((index, error, {"host": None, "elapsed_s": None}))

        with scope:
            try:
                async with trio.open_nursery() as groups:
                    for group_id, rows in call.groups_to_run().items():
                        groups.start_soon(one, group_id, rows)
            except BaseException as exc:
                call.answered.put(_Ended(exc))
                raise
            finally:
                self._calls.pop(call.call_id, None)


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
        self, rows: Sequence[Mapping[str, Any]] | None, call_id: str | None = None
    ) -> Iterator[tuple[int, Any, dict[str, Any]]]:
        """``(row index, result, timing)`` per row, in completion order (a streaming generator:
        ``.options(num_returns="streaming")``). ``call_id``: continue a call ``restore``
        brought back (its rows may be left out)."""
        if self._session is None:
            raise SessionFailed("call spinup first")
        yield from self._session.rows_as_completed(rows, _ray_cancelled, call_id)

    def checkpoint(self, directory: str) -> dict[str, Any]:
        """A checkpoint of the hosts and of what was yielded (see the module docstring)."""
        return self._started().checkpoint(directory)

    def restore(self, directory: str) -> dict[str, Any]:
        """Restore ``directory``'s checkpoint into this (fresh) actor; the calls to continue."""
        return self._started().restore(directory)

    def _started(self) -> Session:
        if self._session is None:
            raise SessionFailed("call spinup first")
        return self._session

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
