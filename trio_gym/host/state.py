"""What all connections of one serving process share: readiness, runner, counters, shutdown."""

from __future__ import annotations

import secrets

import attrs
import trio

from trio_gym.config import ServeConfig
from trio_gym.errors import ErrorCode, WireError
from trio_gym.install import InstallError, install_environment
from trio_gym.logs import log_event
from trio_gym.runners import Runner, load_runner


@attrs.frozen
class Starting:
    stage: str


@attrs.frozen
class Ready:
    pass


@attrs.frozen
class Failed:
    stage: str
    message: str


Phase = Starting | Ready | Failed


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

    @property
    def examples_running(self) -> int:
        ended = self.examples_completed + self.examples_failed + self.examples_cancelled
        return self.examples_started - ended


class Host:
    """The serving process's shared state.

    Given a ``runner``, the host is ready at once (embedding, tests); otherwise
    :meth:`bootstrap` loads ``config.runner`` while ``/health`` says ``starting``.
    """

    def __init__(self, config: ServeConfig, *, runner: Runner | None = None) -> None:
        self.config = config
        self.limits = config.http_limits()
        self.stats = HostStats()
        self.shutdown_requested = trio.Event()
        self.connection_slots = trio.CapacityLimiter(config.max_connections)
        self._runner = runner
        self.phase: Phase = Ready() if runner is not None else Starting("starting")
        self.settled = trio.Event()
        """Set once start-up ended, ready or failed."""
        if runner is not None:
            self.settled.set()

    @property
    def runner(self) -> Runner:
        if self._runner is None:
            raise RuntimeError("the runner is not loaded yet; check accepting() first")
        return self._runner

    async def bootstrap(self) -> None:
        """Run the start-up stages; on failure, keep serving ``/health`` with the reason.

        Stages: ``installing`` (the environment package, :mod:`trio_gym.install`), then
        ``starting_runner`` (importing the runner, in a worker thread so that a slow import
        leaves ``/health`` answering). Never raises but ``Cancelled``: a failure is recorded in
        :attr:`phase` for the orchestrator to read, and the process stays up to report it.
        """
        try:
            if self._runner is None:
                await self._run_stages()
        finally:
            self.settled.set()

    async def _run_stages(self) -> None:
        try:
            self._enter("installing")
            await install_environment(self.config)
            self._enter("starting_runner")
            self._runner = await trio.to_thread.run_sync(load_runner, self.config.runner)
        except Exception as exc:  # the boundary: a user's package or module may fail any way
            assert isinstance(self.phase, Starting)
            message = str(exc) if isinstance(exc, InstallError) else f"{type(exc).__name__}: {exc}"
            self.phase = Failed(self.phase.stage, message)
            log_event("stage_failed", stage=self.phase.stage, error=message)
            return
        self.phase = Ready()
        log_event("ready", runner=self.config.runner)

    def _enter(self, stage: str) -> None:
        self.phase = Starting(stage)
        log_event("stage_started", stage=stage)

    def request_shutdown(self) -> None:
        """Stop accepting work; in-flight batches are answered ``shutting_down``."""
        if not self.shutdown_requested.is_set():
            log_event("shutdown_requested")
            self.shutdown_requested.set()

    def check_accepting(self) -> None:
        """Return if a batch would be accepted now; else raise the 503 that says why not."""
        if self.shutdown_requested.is_set():
            raise WireError(ErrorCode.SHUTTING_DOWN, "the host is shutting down; send elsewhere")
        if isinstance(self.phase, Starting):
            raise WireError(
                ErrorCode.NOT_READY,
                f"the host is starting (stage {self.phase.stage}); poll GET /health until ready",
                headers=[("retry-after", "1")],
            )
        if isinstance(self.phase, Failed):
            raise WireError(
                ErrorCode.BOOTSTRAP_FAILED,
                f"the host failed to start at stage {self.phase.stage}: {self.phase.message}",
            )

    def health(self) -> tuple[int, dict[str, object]]:
        """The ``/health`` answer of DESIGN §3.2: 200 only when a batch would be accepted."""
        if isinstance(self.phase, Failed):
            error = {"code": ErrorCode.BOOTSTRAP_FAILED.value, "message": self.phase.message}
            return 503, {"status": "failed", "stage": self.phase.stage, "error": error}
        if isinstance(self.phase, Starting):
            return 503, {"status": "starting", "stage": self.phase.stage}
        if self.shutdown_requested.is_set():
            return 503, {"status": "shutting_down"}
        return 200, {"status": "ready"}


def new_batch_id() -> str:
    """Random, so log lines of different host processes never share a batch id."""
    return secrets.token_hex(6)
