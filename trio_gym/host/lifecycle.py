"""A host's life: its start-up (one table of phases, and the stages that move through it), its
runner, and its stop — and the one decision, drawn from both, of whether a batch is accepted.

::

    starting(stage)  --next stage, or what it waits for-->  starting(stage)
    starting         --the runner is up-->                   ready
    starting, ready  --a stage failed, or Gym ended-->       failed   (final: the first cause stays)

Stopping is not a phase: a host in any phase may be asked to stop, and stopping outranks the
phase in every answer (:meth:`Lifecycle.refusal`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Final

import attrs
import trio

from trio_gym.changes import Changes
from trio_gym.config import ServeConfig
from trio_gym.errors import ErrorCode, WireError
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

STAGES: Final = (
    "starting",
    "installing",
    "starting_gym",
    "starting_runner",
    "ready",
    "failed",
    "shutting_down",
)
"""Every value of :attr:`Lifecycle.stage`."""

# Every legal move, by the kind of phase. A move the table does not hold is not made: a stage
# that had not noticed the failure, or a second failure, never replaces the first cause, the
# one an orchestrator needs to read.
MOVES: Final[dict[type[StartupPhase], frozenset[type[StartupPhase]]]] = {
    Starting: frozenset({Starting, Ready, Failed}),
    Ready: frozenset({Failed}),
    Failed: frozenset(),
}


class Lifecycle:
    """Start-up, the runner, and stopping, for one serving process.

    Given a ``runner``, the host is ready at once (embedding, tests); otherwise
    :meth:`bootstrap` loads ``config.runner`` while ``/health`` says ``starting``.
    """

    def __init__(
        self,
        config: ServeConfig,
        *,
        runner: Runner | None = None,
        wall_time: Callable[[], float] = time.time,  # clock-ok: a stage's start is a wall time
    ) -> None:
        self._config = config
        self._runner = runner
        self._phase: StartupPhase = Ready() if runner is not None else Starting("starting")
        self._phase_changes = Changes()
        self.settled = trio.Event()
        """Set once start-up ended, ready or failed."""
        self.health_notes: list[str] = []
        """What the runner asked ``/health`` to say while the host serves (a capability it
        lacks here); shown as the ready answer's ``detail``."""
        self._stages = trio.CancelScope()
        """Around the start-up stages: a Gym that ends meanwhile ends them."""
        self._gym = trio.CancelScope()
        """Around the Gym deployment's task: a start-up that fails after Gym started stops it."""
        self.shutdown_requested = trio.Event()
        self._stoppable: set[trio.CancelScope] = set()
        self.gym: GymDeployment | None = None
        """The Gym deployment the host owns (runner ``gym``), once it is being started."""
        if runner is not None:
            self.settled.set()
        self._wall_time = wall_time
        self._stage = self.stage
        self.stage_started_at = wall_time()
        """When the host entered :attr:`stage`, in seconds since the Unix epoch."""

    # --- the phase ------------------------------------------------------------------------

    @property
    def phase(self) -> StartupPhase:
        """Where start-up is: starting (a stage, maybe what it waits for), ready, or failed."""
        return self._phase

    @property
    def stage(self) -> str:
        """The phase as one name: a start stage's, ``ready``, ``failed``, or ``shutting_down``
        (which outranks them all, as in every answer)."""
        if self.shutdown_requested.is_set():
            return "shutting_down"
        phase = self._phase
        if isinstance(phase, Starting):
            return phase.stage
        return "ready" if isinstance(phase, Ready) else "failed"

    def _note_stage(self) -> None:
        if self.stage != self._stage:
            self._stage, self.stage_started_at = self.stage, self._wall_time()

    def _move(self, to: StartupPhase) -> None:
        if type(to) not in MOVES[type(self._phase)]:
            return
        self._phase = to
        self._note_stage()
        self._phase_changes.note()

    async def wait_for_phase(self, predicate: Callable[[StartupPhase], bool]) -> StartupPhase:
        """Sleep until ``predicate(phase)`` holds (woken by every change); return the phase."""
        await self._phase_changes.until(lambda: predicate(self._phase))
        return self._phase

    def _fail(self, stage: str, message: str) -> None:
        if not isinstance(self._phase, Failed):
            log_event("stage_failed", level=logging.ERROR, stage=stage, error=message)
        self._move(Failed(stage, message))

    def _enter(self, stage: str) -> None:
        self._move(Starting(stage))
        log_event("stage_started", stage=stage)

    def progress(self, detail: str) -> None:
        """A start stage says what it waits for (``/health`` shows it)."""
        if isinstance(self._phase, Starting):
            self._move(Starting(self._phase.stage, detail))

    def note(self, text: str) -> None:
        """The runner says what ``/health`` should tell while the host serves."""
        self.health_notes.append(text)

    # --- the runner -----------------------------------------------------------------------

    @property
    def loaded_runner(self) -> Runner | None:
        """The runner once loaded, else ``None``."""
        return self._runner

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            raise RuntimeError("the runner is not loaded yet; call check_accepting() first")
        return self._runner

    def state_participant(self) -> StateParticipant | None:
        """The runner, if it keeps episode state of its own for checkpoints to export."""
        return self._runner if isinstance(self._runner, StateParticipant) else None

    def runner_reports_boundaries(self) -> bool:
        return isinstance(self._runner, BoundaryReporter) and self._runner.reports_boundaries

    async def bootstrap(self, background: trio.Nursery) -> None:
        """Run the start-up stages; on failure, keep serving ``/health`` with the reason.

        Stages: ``installing`` (the environment package, :mod:`trio_gym.install`), for runner
        ``gym`` then ``starting_gym`` (the environment's Gym deployment, started as a task of
        ``background``, which outlives every connection), then ``starting_runner`` (importing
        the runner, in a worker thread so that a slow import leaves ``/health`` answering).
        Never raises but ``Cancelled``: a failure is recorded in :attr:`phase` for the
        orchestrator to read, and the process stays up to report it.
        """
        try:
            if self._runner is None:
                with start_reports_to(self), self._stages:
                    await self._run_stages(background)
        finally:
            self.settled.set()

    async def _run_stages(self, background: trio.Nursery) -> None:
        config = self._config
        try:
            self._enter("installing")
            package = await install_environment(config)
            head_server = ""
            if config.runner == "gym":
                self._enter("starting_gym")
                self.gym = deployment = GymDeployment(config, package)
                ready: GymReady = await background.start(self._keep_gym, deployment)
                head_server = ready.head_url
            self._enter("starting_runner")
            # Abandoned if cancelled: an import cannot be interrupted, and shutdown must not wait
            # for one that hangs (the worker thread is a daemon; it dies with the process).
            runner = await trio.to_thread.run_sync(
                partial(load_runner, config, gym_head_server=head_server),
                abandon_on_cancel=True,
            )
            if isinstance(runner, ServedRunner):  # its tasks live as long as the host serves
                await background.start(runner.serve)
            elif isinstance(runner, StartingRunner):
                await runner.start()
            self._runner = runner
        except Exception as exc:  # the boundary: a user's package or module may fail any way
            known = isinstance(exc, InstallError | GymStartFailed)
            stage = self._phase.stage if isinstance(self._phase, Starting) else "starting"
            self._fail(stage, str(exc) if known else f"{type(exc).__name__}: {exc}")
            self._gym.cancel()  # a host that cannot serve keeps no Gym running for nothing
            return
        self._move(Ready())
        log_event("ready", runner=config.runner)

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

    async def close_runner(self) -> None:
        """Let a runner that holds something release it, once serving ended."""
        if isinstance(self._runner, ClosingRunner):
            await self._runner.aclose()

    # --- stopping -------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """Stop accepting work; in-flight batches are answered ``shutting_down``."""
        if not self.shutdown_requested.is_set():
            log_event("shutdown_requested")
            self.shutdown_requested.set()
            self._note_stage()
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

    # --- whether a batch is accepted ------------------------------------------------------

    def refusal(self) -> WireError | None:
        """Why a batch would be refused right now, or ``None`` when it would be accepted.

        Stopping outranks a failed start, which outranks a start in progress; ``/health`` and
        ``POST /rollouts/run`` both answer from this one decision.
        """
        phase = self._phase
        if self.shutdown_requested.is_set():
            return WireError(ErrorCode.SHUTTING_DOWN, "the host is shutting down; send elsewhere")
        if isinstance(phase, Failed):
            return WireError(
                ErrorCode.BOOTSTRAP_FAILED,
                f"the host failed to start at stage {phase.stage}: {phase.message}",
            )
        if isinstance(phase, Starting):
            return WireError(
                ErrorCode.NOT_READY,
                f"the host is starting (stage {phase.stage}); poll GET /health until ready",
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
        if self._config.host_identity:
            document[HEALTH_IDENTITY_FIELD] = identity_digest(self._config.host_identity)
        return status, document

    def _health(self) -> tuple[int, dict[str, object]]:
        refusal = self.refusal()
        phase = self._phase
        if refusal is None:
            if self.health_notes:
                return 200, {"status": "ready", "detail": "; ".join(self.health_notes)}
            return 200, {"status": "ready"}
        if refusal.code is ErrorCode.SHUTTING_DOWN:
            return 503, {"status": "shutting_down"}
        if isinstance(phase, Failed):
            error = {"code": refusal.code.value, "message": phase.message}
            return 503, {"status": "failed", "stage": phase.stage, "error": error}
        assert isinstance(phase, Starting)
        starting: dict[str, object] = {"status": "starting", "stage": phase.stage}
        if phase.detail:
            starting["detail"] = phase.detail
        return 503, starting
