"""Checkpoint-aware dispatch: each group's attempts sent to their hosts over row streams.

A group (one prompt) has one sibling per generation; :meth:`Dispatcher.run_group` sends every
sibling's current attempt to its host — one per-row NDJSON request per host, so an episode
parked by a checkpoint never holds back its siblings' rows and a refused row names itself — and
returns when every sibling is sealed. What happens to each row:

==========================================  =============================================
a result (or an example's own error row)    SEALED, handed to ``on_result`` in the same
                                            mutation (consumed exactly once)
``admission_closed`` (a checkpoint)          back to RESERVED with its identity; re-sent once
                                            admission reopens; spends no budget; counted in
                                            :attr:`Dispatcher.admission_closed_rows_total`
the request was not taken (its error's      back to RESERVED with its identity; re-sent
``reach``: no connection, no head, the      once the scheduler finds the host ready, at
host's "not now")                           most ``max_unreached_sends`` times
no row (the stream was cut while the host   ABANDONED, retired on its host at once (under
lives, or the answer was taken and failed), dispatch admission), re-sent as a fresh attempt
or ``stale_attempt`` (the host holds this   under a new rollout id, at most ``max_losses``
identity already)
no row, and the host was lost               recovered on its heir (below)
==========================================  =============================================

Hosts are a :class:`~trio_gym.trainer.scheduler.Scheduler`'s (``async with dispatcher:``): a
new group's siblings go to the healthy hosts with the least unsealed work, each request holds
a slot on its host, and a host that fails is probed, ejected and replaced there. When a host
is lost, its work moves to its heir (its replacement, or the least loaded host left) before
the heir takes anything: episodes of the last checkpoint still running on the lost host are
restored on the heir from that checkpoint's export (as the next attempt, exactly once); the
rest of its unsealed attempts run there afresh. A checkpoint and a recovery never overlap.

The gate rule: an attempt is marked DISPATCHED inside the gate's admission, in the same
mutation that precedes its submission, and the admission lasts until the host has answered the
request's head (it holds the batch). A checkpoint closing the gate therefore waits for those
submissions and counts exactly the attempts its hosts really have; an attempt waiting at the
closed gate is still RESERVED and is not counted.

A group whose ``run_group`` is cancelled (the trainer dropped it) has its unsealed attempts
abandoned; those its hosts may still run are remembered and retired by the next checkpoint
with dispatch closed, before it prepares.
"""

from __future__ import annotations

import collections
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Final

import attrs
import trio

from trio_gym.errors import ErrorCode, raise_unwrapped
from trio_gym.logs import log_event
from trio_gym.protocol.identity import ATTEMPT_KEY, ROLLOUT_ID_KEY
from trio_gym.trainer.control import ControlError
from trio_gym.trainer.deadlines import DeadlineRegistry
from trio_gym.trainer.errors import Reach, RolloutError
from trio_gym.trainer.gate import DispatchGate
from trio_gym.trainer.hosts import Launcher
from trio_gym.trainer.ledger import Attempt, AttemptState, Ledger
from trio_gym.trainer.metrics import FleetStats
from trio_gym.trainer.recovery import LastCheckpoint, recover
from trio_gym.trainer.scheduler import (
    Connect,
    HostLost,
    Member,
    RemoteHost,
    Scheduler,
    SchedulerSettings,
)
from trio_gym.trainer.stream import Row, RowError, RowStream

DROP_GRACE_S: Final = 5.0
"""How long a cancelled group may wait for the ledger to record that it was dropped."""


@attrs.frozen
class SealedResult:
    """One episode's outcome, consumed once: ``result``, or ``error`` if the episode failed."""

    group_id: str
    sibling: int
    rollout_id: str
    attempt: int
    host: str
    result: Any
    error: RowError | None


class GroupFailed(Exception):
    """A group that cannot finish: a sibling lost too often, or refused for good; ``cause``
    is the last failure of the request that ended it, when one did."""

    def __init__(self, message: str, cause: RolloutError | None = None) -> None:
        super().__init__(message)
        self.cause = cause


@attrs.frozen
class DispatchSettings:
    max_losses: int = 3
    """Attempts a sibling may lose (its row never came) before its group fails."""
    max_admission_refusals: int = 1000
    """Re-sends after ``admission_closed`` for one attempt: a bound so that a host whose
    admission never reopens ends the group instead of livelocking it."""
    admission_retry_s: float = 1.0
    """The pause before re-sending a refused row while this trainer's own gate is open (the
    host's admission was closed by something else)."""
    resend_backoff_s: float = 1.0
    """The pause before re-sending after a request was not taken, or after a loss (a short
    proxy outage must not use up ``max_losses`` in milliseconds)."""
    control_timeout_s: float = 30.0
    """Each control call's deadline: a retire, and a lost host's recovery on its heir."""
    recovery_lease_s: float = 60.0
    """The heir's lease while it restores a lost host's episodes (its admission is closed)."""


class Dispatcher:
    """Runs groups over a scheduler's hosts (``async with dispatcher:``); shares its ledger,
    gate and deadlines with a :class:`~trio_gym.trainer.coordinator.CheckpointCoordinator`.

    ``hosts`` are the hosts it starts with; ``launcher`` (a provider) replaces lost ones, each
    replacement's handle made a host by ``connect`` (default: ``RemoteHost.launched`` with the
    dispatcher's deadlines, which its hosts' clients must share).
    """

    def __init__(
        self,
        hosts: Sequence[RemoteHost],
        on_result: Callable[[SealedResult], None],
        *,
        ledger: Ledger | None = None,
        settings: DispatchSettings | None = None,
        deadlines: DeadlineRegistry | None = None,
        scheduler: SchedulerSettings | None = None,
        launcher: Launcher | None = None,
        connect: Connect | None = None,
        stats: FleetStats | None = None,
    ) -> None:
        self.ledger = ledger or Ledger(incarnation=uuid.uuid4().hex[:8])
        self.gate = DispatchGate()
        self.deadlines = deadlines or DeadlineRegistry()
        self.settings = settings or DispatchSettings()
        self.on_result = on_result
        self.scheduler = Scheduler(
            hosts,
            scheduler,
            launcher=launcher,
            connect=connect or partial(RemoteHost.launched, deadlines=self.deadlines),
            on_lost=self._host_lost,
            stats=stats,
        )
        self.admission_closed_rows_total = 0
        self.to_retire: dict[str, set[tuple[str, int]]] = defaultdict(set)
        """Host -> (rollout id, attempt) it may still run although the ledger gave them up."""
        self.last_checkpoint: LastCheckpoint | None = None
        """The checkpoint a lost host's episodes are recovered from (the coordinator's last)."""
        self.host_changes = trio.Lock()
        """Held by a checkpoint, and by the recovery of a lost host: never both at once."""
        self._streams: dict[str, set[trio.CancelScope]] = defaultdict(set)
        """Host -> the requests in flight to it, cut when it is lost (a host ejected alive
        must not seal rows of attempts its heir now holds)."""
        self.recovered_total = 0
        """Episodes of lost hosts restored on their heirs from a checkpoint."""

    async def __aenter__(self) -> Dispatcher:
        await self.scheduler.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self.scheduler.__aexit__(*exc_info)

    @property
    def hosts(self) -> dict[str, RemoteHost]:
        """The hosts in service, by name."""
        return self.scheduler.hosts

    # --- groups -----------------------------------------------------------------------------

    async def run_group(
        self,
        group_id: str,
        examples: Sequence[Mapping[str, Any]],
        *,
        hosts: Sequence[str] | None = None,
    ) -> None:
        """Run one group to the end: ``examples[i]`` is sibling ``i``'s payload (kept in memory
        only), sent to ``hosts[i]`` (default: the healthy hosts with the least unsealed work). A
        group already in the ledger (after a restore) continues: sealed siblings are not sent
        again, restored ones go to their own host as the next attempt."""
        if hosts is not None and (len(hosts) != len(examples) or not set(hosts) <= set(self.hosts)):
            raise ValueError(f"hosts must name one of {sorted(self.hosts)} per payload")
        async with self.ledger.mutation() as ledger:
            group = ledger.groups.get(group_id)
            if group is None:
                assigned = list(hosts) if hosts is not None else self._assign(len(examples))
                group = ledger.add_group(group_id, assigned)
            elif group.dropped:
                raise ValueError(
                    f"group {group_id!r} was given up (dropped); run it again under a new id"
                )
            elif len(group.siblings) != len(examples):
                raise ValueError(
                    f"group {group_id!r} has {len(group.siblings)} siblings in the ledger; "
                    f"{len(examples)} payloads were given"
                )
        finished = False
        try:
            used = sorted(self._hosts_with_work_to_send(group_id))
            await self._on_each_host(group_id, used, examples, _Budget())
            finished = True
        finally:  # cancelled or failed: the group is given up (cleanup under a bounded shield)
            if not finished:
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + DROP_GRACE_S
                    await self._drop(group_id)

    async def _on_each_host(
        self,
        group_id: str,
        hosts: list[str],
        examples: Sequence[Mapping[str, Any]],
        budget: _Budget,
    ) -> None:
        """Each host's siblings in their own loop (a re-send to one host never waits for
        another host's stream), one loop per host at a time: a loop whose host was lost hands
        on to its heir's. A :class:`GroupFailed` surfaces as itself."""
        looping: set[str] = set()

        async def host_loop(host: str) -> None:
            try:
                while attempts := await self._waiting(group_id, host, budget):
                    await self._send(host, attempts, examples, budget)
            except HostLost as lost:
                if lost.heir is None:
                    raise GroupFailed(f"group {group_id!r}: {lost}") from lost
            finally:
                looping.discard(host)
            # Work may have moved to a heir meanwhile (this host was lost between sends).
            for pending in self._hosts_with_work_to_send(group_id):
                if self.scheduler.heir_of(pending) != pending:  # lost, its work never moved
                    raise GroupFailed(f"group {group_id!r}: work is left on {pending}, lost")
                loop_on(pending)

        def loop_on(host: str) -> None:
            host = self.scheduler.heir_of(host) or host
            if host not in looping:
                looping.add(host)
                nursery.start_soon(host_loop, host)

        try:
            async with trio.open_nursery() as nursery:
                for host in hosts:
                    loop_on(host)
        except ExceptionGroup as group:
            raise_unwrapped(group, alike=GroupFailed)

    def _hosts_with_work_to_send(self, group_id: str) -> set[str]:
        """Hosts holding a sibling of the group that waits to be sent (a request in flight
        has its loop already)."""
        waiting = (AttemptState.RESERVED, AttemptState.ABANDONED)
        siblings = self.ledger.groups[group_id].siblings
        return {s.current.host for s in siblings if s.current.state in waiting}

    def _assign(self, siblings: int) -> list[str]:
        """Each sibling on the healthy host with the least unsealed work (every host in service
        when none is healthy now)."""
        names = self.scheduler.healthy() or list(self.hosts)
        load = collections.Counter({name: 0 for name in names})
        for state in (AttemptState.RESERVED, AttemptState.DISPATCHED):
            load.update(a.host for a in self.ledger.in_state(state) if a.host in load)
        assigned = []
        for _ in range(siblings):
            host = min(names, key=lambda name: load[name])
            load[host] += 1
            assigned.append(host)
        return assigned

    async def _waiting(self, group_id: str, host: str, budget: _Budget) -> list[Attempt]:
        """The group's attempts to send to ``host`` now; abandoned siblings get a fresh
        attempt (or fail the group when they have lost too often)."""
        async with self.ledger.mutation() as ledger:
            waiting: list[Attempt] = []
            for sibling in ledger.groups[group_id].siblings:
                attempt = sibling.current
                if attempt.host != host:
                    continue
                if attempt.state is AttemptState.ABANDONED:
                    losses = sum(a.state is AttemptState.ABANDONED for a in sibling.attempts)
                    if losses >= self.settings.max_losses:
                        cause = budget.losses.get(attempt.capture_key)
                        raise GroupFailed(
                            f"group {group_id!r}: sibling {sibling.index} lost its row "
                            f"{losses} times (max_losses={self.settings.max_losses}); the last "
                            f"attempt was {attempt.capture_key} on {attempt.host}"
                            + (f": {cause.message}" if cause else ""),
                            cause,
                        )
                    attempt = ledger.retry(attempt.capture_key)
                if attempt.state is AttemptState.RESERVED:
                    waiting.append(attempt)
            return waiting

    async def _drop(self, group_id: str) -> None:
        """The group was given up: its unsealed attempts are abandoned, and those a host may
        still run are queued for the next checkpoint to retire."""
        async with self.ledger.mutation() as ledger:
            for attempt in ledger.drop(group_id):
                self.queue_retire(attempt)
        log_event("group_dropped", group=group_id)

    # --- one request ------------------------------------------------------------------------

    async def _send(
        self,
        host: str,
        attempts: list[Attempt],
        examples: Sequence[Mapping[str, Any]],
        budget: _Budget,
    ) -> None:
        """One request for ``attempts`` on ``host``, in one of its slots; :class:`HostLost` if
        the host was lost before or while it ran (its work is then its heir's)."""
        keys = [attempt.capture_key for attempt in attempts]
        payload = [
            {
                **examples[self.ledger.sibling_of(key).index],
                ROLLOUT_ID_KEY: attempt.rollout_id,
                ATTEMPT_KEY: attempt.number,
            }
            for key, attempt in zip(keys, attempts, strict=True)
        ]
        async with self.scheduler.slot(host) as member:
            with trio.CancelScope() as lost:  # cancelled when the host is lost (_host_lost)
                self._streams[host].add(lost)
                rows = member.host.client.stream(payload)
                stats = self.scheduler.stats
                stats.chunks_sent += 1
                stats.chunks_in_flight += 1
                try:
                    failure = await self._submit(member, keys, rows, budget)
                    if failure is None:
                        lost_some = await self._read_rows(member, keys, rows, budget)
                    elif failure.reach is Reach.UNREACHED:
                        stats.chunks_requeued += 1
                        lost_some = False
                    else:  # the host may have taken the batch: never re-sent under these ids
                        stats.chunks_failed[failure.origin.value] += 1
                        log_event("request_unanswered", host=host, error=str(failure))
                        budget.losses.update(dict.fromkeys(keys, failure))
                        await self._lose(host, keys)
                        lost_some = True
                finally:
                    stats.chunks_in_flight -= 1
                    self._streams[host].discard(lost)
                    await rows.aclose()
        if lost.cancelled_caught:  # its work is being moved to its heir: follow it there
            await self.scheduler.until_settled(member)
        if failure is not None or lost_some:
            await trio.sleep(self.settings.resend_backoff_s)
        elif self.gate.is_open and any(
            self.ledger.attempt(key).state is AttemptState.RESERVED for key in keys
        ):
            # Refused admission_closed by something other than this trainer's gate (which
            # would hold the re-send until it opens): wait as the host's Retry-After asks.
            await trio.sleep(self.settings.admission_retry_s)

    async def _submit(
        self, member: Member, keys: list[str], rows: RowStream, budget: _Budget
    ) -> RolloutError | None:
        """Mark and send inside one gate admission, held until the host's answer head; the
        error if no head came (attempts the host did not take are RESERVED again before the
        admission ends)."""
        async with self.gate.admission():
            async with self.ledger.mutation() as ledger:
                for key in keys:
                    ledger.dispatch(key, member.name)
            try:
                await rows.start()
            except RolloutError as error:
                self.scheduler.failed(member, error)
                if error.reach is not Reach.TAKEN:
                    await self._not_taken(keys, error, budget)
                return error
            return None

    async def _read_rows(
        self, member: Member, keys: list[str], rows: RowStream, budget: _Budget
    ) -> bool:
        """Settle each row as it comes; rows that never came are lost — unless their host was
        lost too, and the recovery moved them to its heir (then :class:`HostLost`). True if any
        was lost."""
        host = member.name
        stale = False
        try:
            async for row in rows:
                stale |= await self._settle(keys[row.index], row, budget)
        except RolloutError as error:
            self.scheduler.stats.chunks_failed[error.origin.value] += 1
            log_event("stream_cut", host=host, error=str(error), missing=len(rows.missing))
            for index in rows.missing:
                budget.losses[keys[index]] = error
            self.scheduler.failed(member, error)
            if rows.missing:
                await self.scheduler.until_settled(member)
        else:
            self.scheduler.stats.chunks_answered += 1
            self.scheduler.succeeded(member)
        missing = [keys[index] for index in rows.missing]
        await self._lose(host, missing)
        if stale and not missing:
            await self._retire_now(host)
        return stale or bool(missing)

    async def _settle(self, key: str, row: Row, budget: _Budget) -> bool:
        """Record one row. ``stale_attempt`` (the host holds or retired this identity, e.g. a
        dead trainer process's copy) is a loss, not the episode's outcome: ABANDONED and queued
        to retire at once, in this mutation (a checkpoint's drain must not wait for it); True
        then."""
        async with self.ledger.mutation() as ledger:
            if not ledger.in_flight(key):  # its host was lost meanwhile: the heir has it now
                log_event("row_of_a_moved_attempt", key=key)
                return False
            code = row.error.code if row.error is not None else None
            if code == ErrorCode.ADMISSION_CLOSED:
                ledger.move(key, AttemptState.RESERVED)  # same identity, nothing spent
                self.admission_closed_rows_total += 1
                budget.refused(key, self.settings.max_admission_refusals)
                return False
            if code == ErrorCode.STALE_ATTEMPT:
                self.queue_retire(ledger.move(key, AttemptState.ABANDONED))
                log_event("attempt_stale", key=key, message=row.error.message if row.error else "")
                return True
            attempt = ledger.move(key, AttemptState.SEALED)
            sibling = ledger.sibling_of(key)
            self.on_result(
                SealedResult(
                    sibling.group_id,
                    sibling.index,
                    attempt.rollout_id,
                    attempt.number,
                    attempt.host,
                    row.result,
                    row.error,
                )
            )
            return False

    async def _not_taken(self, keys: list[str], error: RolloutError, budget: _Budget) -> None:
        """The host did not take the request: its episodes keep their identity. One that it
        refuses for what it is (too large, invalid) fails the group at once, naming why."""
        async with self.ledger.mutation() as ledger:
            for key in keys:
                ledger.move(key, AttemptState.RESERVED)  # no host holds them: nothing to retire
        if error.reach is Reach.REFUSED:
            raise GroupFailed(f"the request was refused for what it is: {error}", error) from error
        for key in keys:
            budget.unreached(key, self.scheduler.settings.max_unreached_sends, error)
        log_event("request_unreached", keys=len(keys), error=str(error))

    async def _lose(self, host: str, keys: list[str]) -> None:
        """Rows that never came: abandon them and retire them on the host at once (it may
        still run them); a retire that fails is left for the next checkpoint."""
        if not keys:
            return
        async with self.ledger.mutation() as ledger:
            for key in keys:
                self.queue_retire(ledger.move(key, AttemptState.ABANDONED))
        await self._retire_now(host)

    async def _retire_now(self, host: str) -> None:
        """Retire what ``host`` has queued, under dispatch admission (the host accepts a retire
        only when no checkpoint is open); a failure is logged and left to the next checkpoint."""
        async with self.gate.admission():
            try:
                await self.retire_queued(host)
            except ControlError as error:
                log_event("retire_deferred", host=host, error=str(error))

    # --- lost hosts -------------------------------------------------------------------------

    async def _host_lost(self, lost: RemoteHost, heir: RemoteHost | None) -> None:
        """The scheduler lost ``lost``: its work moves to ``heir`` before the heir takes
        any (:mod:`trio_gym.trainer.recovery`); nothing of it is left to retire there."""
        for stream in self._streams.pop(lost.name, ()):
            stream.cancel()
        async with self.host_changes:
            restored, orphans = await recover(
                self.ledger,
                lost.name,
                heir,
                self.last_checkpoint,
                timeout_s=self.settings.control_timeout_s,
                lease_s=self.settings.recovery_lease_s,
            )
        self.recovered_total += len(restored)
        self.to_retire.pop(lost.name, None)
        if heir is not None:  # restored for a group dropped meanwhile: the next retire stops it
            self.to_retire[heir.name].update(orphans)

    # --- retiring ---------------------------------------------------------------------------

    def queue_retire(self, attempt: Attempt) -> None:
        """Remember an attempt the ledger gave up that its host may still run."""
        self.to_retire[attempt.host].add((attempt.rollout_id, attempt.number))

    async def retire_queued(self, host: str) -> None:
        """Retire what ``host`` may still run of attempts the ledger gave up; those retired
        are forgotten here, the rest stay queued. Raises :class:`ControlError` (a
        :class:`~trio_gym.trainer.control.ReplyMismatch` for a reply that does not fit)."""
        queued = sorted(self.to_retire.get(host, ()))
        if not queued:
            return
        control = self.hosts[host].control
        reply = await control.retire(
            f"retire-{uuid.uuid4().hex[:16]}", queued, timeout_s=self.settings.control_timeout_s
        )
        still = reply.still_stopping.count
        if still != 0:  # marked, but some copies had not ended by the deadline: not done yet
            log_event("retire_unfinished", host=host, still_stopping=still)
            return
        self.to_retire[host].difference_update(queued)
        log_event("attempts_retired", host=host, count=len(queued))


@attrs.define
class _Budget:
    """One group's re-sends that spend no attempt, each bounded per attempt."""

    admission_refusals: dict[str, int] = attrs.field(factory=lambda: defaultdict(int))
    unreached_sends: dict[str, int] = attrs.field(factory=lambda: defaultdict(int))
    losses: dict[str, RolloutError] = attrs.field(factory=dict)
    """Capture key -> why its row never came (for the group's failure, if it ends it)."""

    def refused(self, key: str, limit: int) -> None:
        self.admission_refusals[key] += 1
        if self.admission_refusals[key] > limit:
            raise GroupFailed(
                f"{key} was refused admission_closed {self.admission_refusals[key]} times "
                f"(max_admission_refusals={limit}): its host's admission never reopened"
            )

    def unreached(self, key: str, limit: int, error: RolloutError) -> None:
        self.unreached_sends[key] += 1
        if self.unreached_sends[key] > limit:
            raise GroupFailed(
                f"{key} was not taken by its host in {self.unreached_sends[key]} sends "
                f"(max_unreached_sends={limit}): {error}",
                error,
            ) from error
