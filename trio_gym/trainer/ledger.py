"""The recovery ledger: which episode attempts exist, where they run, and what became of them.

A trainer samples *groups* (one prompt), each with *siblings* (one per generation); every sibling
has a list of *attempts*, the last of which is current. An attempt lives through

    RESERVED --dispatch--> DISPATCHED --seal--> SEALED
        ^                      |
        +--admission refused---+            (same identity, nothing spent)
    RESERVED | DISPATCHED --abandon--> ABANDONED   (a retry appends a fresh RESERVED attempt)

and knows its rollout id, attempt number, host and capture key (the rollout id, ``-a<N>``
appended for N > 0 — the host's name for the episode). Rollout ids are
``{group}.{sibling}[@{incarnation}][.g{n}]``: the trainer process's incarnation, and the
sibling's generation after a loss.

Every change happens inside one *barrier mutation* (``async with ledger.mutation():``): a lock,
a mutation counter and a condition. A checkpoint that holds the lock sees a consistent cut; a
task waiting for something to change (a drain waiting for replies) sleeps until the next
mutation (:meth:`Ledger.wait_for_mutation`) and never polls.

The ledger persists as versioned JSON in a checkpoint (:meth:`Ledger.to_json`); loading is
strict (:meth:`Ledger.from_json`): unknown fields, another version or an episode listed twice are
refused with the reason. Payloads and live handles stay in memory, never in the checkpoint.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import AsyncIterator, Iterator
from typing import Any, Final, Literal

import attrs
import trio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trio_gym.errors import describe_validation_error
from trio_gym.protocol.identity import capture_key

LEDGER_VERSION: Final = 1


class AttemptState(enum.Enum):
    RESERVED = "reserved"  # not sent anywhere yet (or sent and refused at admission)
    DISPATCHED = "dispatched"  # submitted to its host; a reply may still come
    SEALED = "sealed"  # its result is in: trained on, never sent again
    ABANDONED = "abandoned"  # given up; the host may still run it until retired


class LedgerError(Exception):
    """A move the state table does not allow, or a ledger that cannot be loaded as it is."""


@attrs.define
class Attempt:
    rollout_id: str
    number: int
    host: str
    """The host instance (its URL) this attempt runs on; a restored attempt keeps its host."""
    state: AttemptState = AttemptState.RESERVED

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.number)


@attrs.define
class Sibling:
    group_id: str
    index: int
    attempts: list[Attempt]

    @property
    def current(self) -> Attempt:
        return self.attempts[-1]

    @property
    def generation(self) -> int:
        """How many fresh rollout ids this sibling has had (a re-send after a loss takes a new
        one; a restore keeps it)."""
        return len({attempt.rollout_id for attempt in self.attempts}) - 1


@attrs.define
class Group:
    group_id: str
    siblings: list[Sibling]
    dropped: bool = False
    """The trainer gave the group up (cancelled or failed): a restore does not bring it back."""


# Legal moves, in one place.
MOVES: Final[dict[AttemptState, frozenset[AttemptState]]] = {
    AttemptState.RESERVED: frozenset({AttemptState.DISPATCHED, AttemptState.ABANDONED}),
    AttemptState.DISPATCHED: frozenset(
        {AttemptState.SEALED, AttemptState.RESERVED, AttemptState.ABANDONED}
    ),
    AttemptState.SEALED: frozenset(),
    AttemptState.ABANDONED: frozenset(),
}


class Ledger:
    """Groups, siblings and attempts, changed only inside :meth:`mutation`."""

    def __init__(self, incarnation: str = "") -> None:
        self.incarnation = incarnation
        """Part of every rollout id this ledger mints (not persisted): a trainer process that
        starts or restores takes a fresh one, so its new work can never collide with an earlier
        process's work that a host may still hold (dispatched after that process's last
        checkpoint). Restored attempts keep their own ids."""
        self._groups: dict[str, Group] = {}
        self._by_key: dict[str, tuple[Sibling, Attempt]] = {}
        self._changed = trio.Condition()
        self.mutations = 0
        """How many mutations have completed (a waiter's cursor)."""

    # --- the barrier ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def mutation(self) -> AsyncIterator[Ledger]:
        """Hold the ledger for one consistent change; waiters wake when it ends."""
        async with self._changed:
            try:
                yield self
            finally:
                self.mutations += 1
                self._changed.notify_all()

    async def wait_for_mutation(self, after: int) -> int:
        """Sleep until a mutation later than cursor ``after`` has completed; the new cursor."""
        async with self._changed:
            while self.mutations <= after:
                await self._changed.wait()
            return self.mutations

    def _check_held(self) -> None:
        if not self._changed.locked():
            raise LedgerError("the ledger is changed only inside `async with ledger.mutation()`")

    # --- reading --------------------------------------------------------------------------

    @property
    def groups(self) -> dict[str, Group]:
        return self._groups

    def attempt(self, key: str) -> Attempt:
        """The attempt whose capture key is ``key`` (``KeyError`` if unknown)."""
        return self._by_key[key][1]

    def sibling_of(self, key: str) -> Sibling:
        return self._by_key[key][0]

    def in_flight(self, key: str) -> bool:
        """Whether ``key`` is its sibling's current attempt and DISPATCHED: a host may hold it
        and its reply may still come."""
        sibling, attempt = self._by_key[key]
        return attempt.state is AttemptState.DISPATCHED and sibling.current is attempt

    def in_state(self, state: AttemptState) -> Iterator[Attempt]:
        for sibling, attempt in self._by_key.values():
            if attempt.state is state and sibling.current is attempt:
                yield attempt

    # --- changing (inside a mutation) -----------------------------------------------------

    def add_group(self, group_id: str, hosts: list[str]) -> Group:
        """A new group with one sibling per entry of ``hosts``, each a RESERVED attempt 0."""
        self._check_held()
        if group_id in self._groups:
            raise LedgerError(f"group {group_id!r} is already in the ledger")
        siblings = []
        for index, host in enumerate(hosts):
            sibling = Sibling(group_id, index, [])
            rollout_id = self._rollout_id(group_id, index, 0)
            self._append(sibling, Attempt(rollout_id, 0, host))
            siblings.append(sibling)
        group = Group(group_id, siblings)
        self._groups[group_id] = group
        return group

    def move(self, key: str, to: AttemptState) -> Attempt:
        """Move the current attempt ``key`` to ``to``; ``LedgerError`` for an illegal move (a
        bug: a reply for an attempt already sealed, a dispatch of a stale attempt)."""
        self._check_held()
        sibling, attempt = self._by_key[key]
        if sibling.current is not attempt:
            raise LedgerError(f"{key} is not its sibling's current attempt")
        if to not in MOVES[attempt.state]:
            raise LedgerError(f"{key}: illegal move {attempt.state.value} -> {to.value}")
        attempt.state = to
        return attempt

    def dispatch(self, key: str, host: str) -> Attempt:
        """Mark the current attempt ``key`` DISPATCHED to ``host`` — inside the gate's
        admission, as it is submitted. An attempt runs only on its own host: a restored one
        continues where its episode was exported, and sending it elsewhere is refused."""
        attempt = self.attempt(key)
        if attempt.host != host:
            raise LedgerError(f"{key} belongs to host {attempt.host!r}, not {host!r}")
        return self.move(key, AttemptState.DISPATCHED)

    def drop(self, group_id: str) -> list[Attempt]:
        """Give the group up: its unsealed current attempts are ABANDONED. Returns those that
        were DISPATCHED (a host may still run them)."""
        self._check_held()
        group = self._groups[group_id]
        group.dropped = True
        dispatched = []
        for sibling in group.siblings:
            attempt = sibling.current
            if attempt.state is AttemptState.DISPATCHED:
                dispatched.append(attempt)
            if attempt.state in (AttemptState.RESERVED, AttemptState.DISPATCHED):
                attempt.state = AttemptState.ABANDONED
        return dispatched

    def retry(self, key: str, *, host: str | None = None) -> Attempt:
        """After ``key`` was abandoned: a fresh RESERVED attempt 0 under a new rollout id (the
        host may still run the old one until it is retired)."""
        self._check_held()
        sibling, attempt = self._by_key[key]
        if attempt.state is not AttemptState.ABANDONED or sibling.current is not attempt:
            raise LedgerError(f"{key}: only the current, abandoned attempt is retried")
        fresh = Attempt(
            self._rollout_id(sibling.group_id, sibling.index, sibling.generation + 1),
            0,
            host or attempt.host,
        )
        return self._append(sibling, fresh)

    def rehost(self, old: str, new: str) -> None:
        """Hand ``old``'s unfinished work to ``new`` (a restore onto the host that took the
        place of one that left): every current attempt on ``old`` that is not SEALED moves.
        Nothing of it can still run on ``old``: that host is gone."""
        self._check_held()
        for group in self.groups.values():
            for sibling in group.siblings:
                if sibling.current.host == old and sibling.current.state is not AttemptState.SEALED:
                    sibling.current.host = new

    def next_attempt(self, key: str) -> Attempt:
        """After a restore: the same rollout as attempt + 1, RESERVED, on the same host."""
        self._check_held()
        sibling, attempt = self._by_key[key]
        if sibling.current is not attempt:
            raise LedgerError(f"{key} is not its sibling's current attempt")
        return self._append(sibling, Attempt(attempt.rollout_id, attempt.number + 1, attempt.host))

    def _rollout_id(self, group_id: str, index: int, generation: int) -> str:
        base = f"{group_id}.{index}" + (f"@{self.incarnation}" if self.incarnation else "")
        return base if generation == 0 else f"{base}.g{generation}"

    def _append(self, sibling: Sibling, attempt: Attempt) -> Attempt:
        if attempt.capture_key in self._by_key:
            raise LedgerError(f"episode {attempt.capture_key} is already in the ledger")
        sibling.attempts.append(attempt)
        self._by_key[attempt.capture_key] = (sibling, attempt)
        return attempt

    # --- persistence ----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return _LedgerFile(
            version=LEDGER_VERSION,
            groups=[
                _GroupFile(
                    group_id=group.group_id,
                    dropped=group.dropped,
                    siblings=[
                        _SiblingFile(
                            index=sibling.index,
                            attempts=[
                                _AttemptFile(
                                    rollout_id=a.rollout_id,
                                    attempt=a.number,
                                    host=a.host,
                                    state=a.state.value,
                                )
                                for a in sibling.attempts
                            ],
                        )
                        for sibling in group.siblings
                    ],
                )
                for group in self._groups.values()
            ],
        ).model_dump()

    @classmethod
    def from_json(cls, document: object, *, incarnation: str = "") -> Ledger:
        """A ledger from :meth:`to_json`'s output, minting new ids under ``incarnation``;
        ``LedgerError`` saying what is wrong."""
        try:
            loaded = _LedgerFile.model_validate(document)
        except ValidationError as exc:
            problems = describe_validation_error(exc)
            raise LedgerError(f"the ledger cannot be loaded: {problems}") from exc
        ledger = cls(incarnation)
        for group in loaded.groups:
            if group.group_id in ledger._groups:
                raise LedgerError(f"the ledger lists group {group.group_id!r} twice")
            siblings = []
            for entry in group.siblings:
                sibling = Sibling(group.group_id, entry.index, [])
                for a in entry.attempts:
                    attempt = Attempt(a.rollout_id, a.attempt, a.host, AttemptState(a.state))
                    try:
                        ledger._append(sibling, attempt)
                    except LedgerError as exc:
                        raise LedgerError(f"the ledger cannot be loaded: {exc}") from None
                siblings.append(sibling)
            ledger._groups[group.group_id] = Group(group.group_id, siblings, group.dropped)
        return ledger


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _AttemptFile(_Strict):
    rollout_id: str = Field(min_length=1)
    attempt: int = Field(ge=0)
    host: str
    state: Literal["reserved", "dispatched", "sealed", "abandoned"]


class _SiblingFile(_Strict):
    index: int = Field(ge=0)
    attempts: list[_AttemptFile] = Field(min_length=1)


class _GroupFile(_Strict):
    group_id: str = Field(min_length=1)
    dropped: bool = False
    siblings: list[_SiblingFile]


class _LedgerFile(_Strict):
    version: Literal[1]
    groups: list[_GroupFile]
