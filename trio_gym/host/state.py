"""What all connections of one serving process share: readiness, runner, counters, shutdown."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Final

import attrs
import trio

from trio_gym.config import ServeConfig
from trio_gym.errors import ErrorCode, WireError
from trio_gym.http import encode_json
from trio_gym.install import InstallError, install_environment
from trio_gym.logs import log_event
from trio_gym.protocol.host_identity import HEALTH_IDENTITY_FIELD, identity_digest
from trio_gym.runners import Runner, load_runner
from trio_gym.runners.base import (
    BoundaryReporter,
    ClosingRunner,
    ServedRunner,
    StartingRunner,
    StateParticipant,
    start_reports_to,
)
from trio_gym.runners.gym import GymDeployment, GymReady, GymStartFailed

from .checkpoint import Checkpoints
from .pacer import Pacer
from .reattach import KeyedBatches

# How long an over-cap connection may take to send its head, and how long its close drains.
REFUSAL_TIMEOUT_S: Final = 2.0


@attrs.frozen
class Starting:
    stage: str
    detail: str = ""
    """What the stage is waiting for, when it says (a deployment not up yet)."""


@attrs.frozen
class Ready:
    pass


@attrs.frozen
class Failed:
    stage: str
    message: str


StartupPhase = Starting | Ready | Failed


@attrs.frozen
class ResultsInfo:
    """What every results document carries beside the results."""

    job_id: str
    environment_path: str
    work_path: str

    @functools.cached_property
    def encoded(self) -> bytes:
        """The fields as a JSON object, encoded once per host rather than once per batch."""
        return encode_json(attrs.asdict(self))


@attrs.define
class HostStats:
    """Counters a test, a log line or an operator can read. Every example the host starts ends
    in exactly one of completed, failed or cancelled."""

    connections_open: int = 0
    batches_running: int = 0
    examples_started: int = 0
    examples_completed: int = 0
    examples_failed: int = 0
    examples_cancelled: int = 0

    def count_end(self, outcome: str) -> None:
        """Count an example's end: ``completed``, ``failed`` or ``cancelled``."""
        if outcome == "completed":
            self.examples_completed += 1
        elif outcome == "failed":
            self.examples_failed += 1
        else:
            self.examples_cancelled += 1

    @property
    def examples_running(self) -> int:
        ended = self.examples_completed + self.examples_failed + self.examples_cancelled
        return self.examples_started - ended


class Host:
    """The serving process's shared state.

    Given a ``runner``, the host is ready at once (embedding, tests); otherwise
    :meth:`bootstrap` loads ``config.runner`` while ``/health`` says ``starting``.
    """

    def __init__(
        self,
        config: ServeConfig,
        *,
        runner: Runner | None = None,
        wall_time: Callable[[], float] = time.time,  # clock-ok: control calls carry wall times
    ) -> None:
        self.config = config
        self.limits = config.http_limits()
        self.results_info = ResultsInfo(config.job_id, config.environment_path, config.work_path)
        """What every results document carries beside its results (fixed for the host's life)."""
        self.stats = HostStats()
        self.keyed = KeyedBatches(
            grace_s=config.reattach_grace_s,
            retention_s=config.answer_retention_s,
            retention_bytes=config.answer_retention_bytes,
        )
        """Batches sent with an ``Idempotency-Key``: run in ``serve``'s nursery, attachable."""
        self.shutdown_requested = trio.Event()
        self._stoppable: set[trio.CancelScope] = set()
        self.connection_slots = trio.CapacityLimiter(config.max_connections)
        # Over-cap connections still get a clear 503, up to this many at once, on short
        # timeouts (refusal_limits); a quarter of the cap, at least 8.
        self.overflow_slots = trio.CapacityLimiter(max(8, config.max_connections // 4))
        self.refusal_limits = attrs.evolve(
            self.limits,
            read_timeout_s=min(self.limits.read_timeout_s, REFUSAL_TIMEOUT_S),
            drain_timeout_s=REFUSAL_TIMEOUT_S,
        )
        self._runner = runner
        self._phase: StartupPhase = Ready() if runner is not None else Starting("starting")
        self._phase_changed = trio.Event()
        self.settled = trio.Event()
        """Set once start-up ended, ready or failed."""
        self.health_notes: list[str] = []
        """What the runner asked ``/health`` to say while the host serves (a capability it
        lacks here); shown as the ready answer's ``detail``."""
        self._stages = trio.CancelScope()
        """Around the start-up stages: a Gym that ends meanwhile ends them."""
        self._gym = trio.CancelScope()
        """Around the Gym deployment's task: a start-up that fails after Gym started stops it."""
        self.checkpoints = Checkpoints(
            participant=self._state_participant,
            runner_reports_boundaries=self._runner_reports_boundaries,
            wall_time=wall_time,
        )
        self.episodes = self.checkpoints.episodes
        self.pacer = Pacer()
        """Wakes every batch's heartbeat (one timer for all of them; see ``pacer``)."""
        if runner is not None:
            self.settled.set()

    @property
    def phase(self) -> StartupPhase:
        """Where start-up is: starting (a stage, maybe what it waits for), ready, or failed."""
        return self._phase

    @phase.setter
    def phase(self, phase: StartupPhase) -> None:
        """Failed is final: once start-up has failed (or the runner was lost), nothing that was
        still under way — a stage that had not noticed, a second failure — replaces the first
        cause, which is the one an orchestrator needs to read."""
        if isinstance(self._phase, Failed):
            return
        self._phase = phase
        self._phase_changed.set()
        self._phase_changed = trio.Event()

    async def wait_for_phase(self, predicate: Callable[[StartupPhase], bool]) -> StartupPhase:
        """Sleep until ``predicate(phase)`` holds (woken by every change); return the phase."""
        while not predicate(self._phase):
            await self._phase_changed.wait()
        return self._phase

    @property
    def tracks_episodes(self) -> bool:
        """Whether rows are episodes with identities of their own: with the checkpoint control
        plane on. Off, the host runs rows as the upstream host does — two rows of one identity
        both run, and results gain no identity key the row did not carry."""
        return bool(self.config.control_token)

    def _state_participant(self) -> StateParticipant | None:
        return self._runner if isinstance(self._runner, StateParticipant) else None

    def _runner_reports_boundaries(self) -> bool:
        return isinstance(self._runner, BoundaryReporter) and self._runner.reports_boundaries

    def admit_connection(self) -> trio.CapacityLimiter | None:
        """Take a slot for a new connection: a full one, an overflow one, or ``None`` (full)."""
        for slots in (self.connection_slots, self.overflow_slots):
            try:
                slots.acquire_nowait()
            except trio.WouldBlock:
                continue
            if slots is self.connection_slots:
                self.stats.connections_open += 1
            return slots
        return None

    def release_connection(self, slots: trio.CapacityLimiter) -> None:
        """Give back what :meth:`admit_connection` took; synchronous, so cancellation-safe."""
        if slots is self.connection_slots:
            self.stats.connections_open -= 1
        slots.release()

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            raise RuntimeError("the runner is not loaded yet; call check_accepting() first")
        return self._runner

    async def bootstrap(self, services: trio.Nursery) -> None:
        """Run the start-up stages; on failure, keep serving ``/health`` with the reason.

        Stages: ``installing`` (the environment package, :mod:`trio_gym.install`), for runner
        ``gym`` then ``starting_gym`` (the environment's Gym deployment, started as a task of
        ``services``, which outlives every connection), then ``starting_runner`` (importing the
        runner, in a worker thread so that a slow import leaves ``/health`` answering). Never
        raises but ``Cancelled``: a failure is recorded in :attr:`phase` for the orchestrator
        to read, and the process stays up to report it.
        """
        try:
            if self._runner is None:
                with start_reports_to(self), self._stages:
                    await self._run_stages(services)
        finally:
            self.settled.set()

    async def _run_stages(self, services: trio.Nursery) -> None:
        try:
            self._enter("installing")
            package = await install_environment(self.config)
            head_server = ""
            if self.config.runner == "gym":
                self._enter("starting_gym")
                deployment = GymDeployment(self.config, package)
                ready: GymReady = await services.start(self._keep_gym, deployment)
                head_server = ready.head_url
            self._enter("starting_runner")
            # Abandoned if cancelled: an import cannot be interrupted, and shutdown must not wait
            # for one that hangs (the worker thread is a daemon; it dies with the process).
            runner = await trio.to_thread.run_sync(
                partial(load_runner, self.config, gym_head_server=head_server),
                abandon_on_cancel=True,
            )
            if isinstance(runner, ServedRunner):  # its tasks live as long as the host serves
                await services.start(runner.serve)
            elif isinstance(runner, StartingRunner):
                await runner.start()
            self._runner = runner
        except Exception as exc:  # the boundary: a user's package or module may fail any way
            known = isinstance(exc, InstallError | GymStartFailed)
            stage = self.phase.stage if isinstance(self.phase, Starting) else "starting"
            self._fail(stage, str(exc) if known else f"{type(exc).__name__}: {exc}")
            self._gym.cancel()  # a host that cannot serve keeps no Gym running for nothing
            return
        self.phase = Ready()
        log_event("ready", runner=self.config.runner)

    async def _keep_gym(
        self, deployment: GymDeployment, *, task_status: trio.TaskStatus[GymReady]
    ) -> None:
        """Own the Gym deployment for as long as the host serves; one that exits by itself —
        once up, or while the runner still starts — leaves the host ``failed`` at once (its
        rows cannot run anywhere) and ends the start-up stages."""
        with self._gym:
            ended = await deployment.run(task_status=task_status)
            self._fail("gym", ended)
            self._stages.cancel()

    def _fail(self, stage: str, message: str) -> None:
        if not isinstance(self.phase, Failed):
            log_event("stage_failed", level=logging.ERROR, stage=stage, error=message)
        self.phase = Failed(stage, message)

    def _enter(self, stage: str) -> None:
        self.phase = Starting(stage)
        log_event("stage_started", stage=stage)

    def progress(self, detail: str) -> None:
        """A start stage says what it waits for (``/health`` shows it)."""
        if isinstance(self.phase, Starting):
            self.phase = Starting(self.phase.stage, detail)

    def note(self, text: str) -> None:
        """The runner says what ``/health`` should tell while the host serves."""
        self.health_notes.append(text)

    async def close_runner(self) -> None:
        """Let a runner that holds something release it, once serving ended."""
        if isinstance(self._runner, ClosingRunner):
            await self._runner.aclose()

    def request_shutdown(self) -> None:
        """Stop accepting work; in-flight batches are answered ``shutting_down``."""
        if not self.shutdown_requested.is_set():
            log_event("shutdown_requested")
            self.shutdown_requested.set()
            for scope in self._stoppable:
                scope.cancel()

    def cancel_on_shutdown(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` when the host stops (at once if it already has), until
        :meth:`forget_on_shutdown`. A registry, not a watcher task per batch: a held connection
        is one task fewer."""
        if self.shutdown_requested.is_set():
            scope.cancel()
        self._stoppable.add(scope)

    def forget_on_shutdown(self, scope: trio.CancelScope) -> None:
        self._stoppable.discard(scope)

    def refusal(self) -> WireError | None:
        """Why a batch would be refused right now, or ``None`` when it would be accepted.

        Stopping outranks a failed start, which outranks a start in progress; ``/health`` and
        ``POST /rollouts/run`` both answer from this one decision.
        """
        if self.shutdown_requested.is_set():
            return WireError(ErrorCode.SHUTTING_DOWN, "the host is shutting down; send elsewhere")
        if isinstance(self.phase, Failed):
            return WireError(
                ErrorCode.BOOTSTRAP_FAILED,
                f"the host failed to start at stage {self.phase.stage}: {self.phase.message}",
            )
        if isinstance(self.phase, Starting):
            return WireError(
                ErrorCode.NOT_READY,
                f"the host is starting (stage {self.phase.stage}); poll GET /health until ready",
                headers=[("retry-after", "1")],
            )
        return None

    def check_accepting(self) -> None:
        """Return if a batch would be accepted now; else raise the 503 that says why not."""
        refusal = self.refusal()
        if refusal is not None:
            raise refusal

    def health(self) -> tuple[int, dict[str, object]]:
        """The ``/health`` answer: 200 only when a batch would be accepted; with the digest of
        the identity this host was launched with, if any."""
        status, document = self._health()
        if self.config.host_identity:
            document[HEALTH_IDENTITY_FIELD] = identity_digest(self.config.host_identity)
        return status, document

    def _health(self) -> tuple[int, dict[str, object]]:
        refusal = self.refusal()
        if refusal is None:
            if self.health_notes:
                return 200, {"status": "ready", "detail": "; ".join(self.health_notes)}
            return 200, {"status": "ready"}
        if refusal.code is ErrorCode.SHUTTING_DOWN:
            return 503, {"status": "shutting_down"}
        if isinstance(self.phase, Failed):
            error = {"code": refusal.code.value, "message": self.phase.message}
            return 503, {"status": "failed", "stage": self.phase.stage, "error": error}
        assert isinstance(self.phase, Starting)
        starting: dict[str, object] = {"status": "starting", "stage": self.phase.stage}
        if self.phase.detail:
            starting["detail"] = self.phase.detail
        return 503, starting
