"""What the host holds to keep ``Idempotency-Key`` exactly once, whatever arrives on its port.

A key is its bytes as sent, from a closed alphabet (:func:`idempotency_key`). A key whose batch
ran here is never run again: while its answer is kept the registry (:mod:`.reattach`) holds it,
and afterwards :class:`KeyMemory` does — the keys that ran (:class:`RanKeys`, which only keys
that ran can push out) apart from the keys a ``DELETE`` named before their POST arrived
(:class:`GivenUpKeys`, which never pushes anything out: full, it refuses the ``DELETE`` instead,
so the caller does not take it as done). NOTES.md, "Exactly once against any input", has the
reasons and the sizes.
"""

from __future__ import annotations

import array
import bisect
import collections
import enum
import hashlib
import secrets
from typing import Final

from trio_gym.errors import ErrorCode, WireError
from trio_gym.http.h11_build import h11
from trio_gym.protocol.rollouts import IDEMPOTENCY_KEY_HEADER

MAX_KEY_LENGTH: Final = 255
_KEY_HEADER: Final = IDEMPOTENCY_KEY_HEADER.encode()
_KEY_BYTES: Final = frozenset(range(0x21, 0x7F))
"""Visible ASCII, no space: a UUID, a hash, a path-like name all fit; nothing decodes two ways."""


def idempotency_key(head: h11.Request) -> str | None:
    """The request's key, ``None`` without one; ``invalid_request`` naming the rule (never the
    bytes) for a key outside it."""
    values = [value for name, value in head.headers if name == _KEY_HEADER]
    if not values:
        return None
    if len(values) > 1:
        raise WireError(
            ErrorCode.INVALID_REQUEST,
            f"Idempotency-Key is given {len(values)} times; send it once",
        )
    key = bytes(values[0])
    if not 1 <= len(key) <= MAX_KEY_LENGTH or not _KEY_BYTES.issuperset(key):
        raise WireError(
            ErrorCode.INVALID_REQUEST,
            f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} visible ASCII characters "
            "(0x21 to 0x7E: no space, no byte beyond ASCII; a UUID is one)",
        )
    return key.decode("ascii")


def answer_expired(key: str, why: str) -> WireError:
    """The ``410`` for a key that runs nothing here any more, saying ``why``."""
    return WireError(
        ErrorCode.ANSWER_EXPIRED,
        f"Idempotency-Key: {key} — {why}; nothing is run again under a key that ran or was "
        "given up here: send a new key",
    )


class Gone(enum.Enum):
    """Why a key runs nothing here any more (the 410 says it)."""

    EXPIRED = "its answer is no longer kept"
    GIVEN_UP = "its caller gave it up (DELETE)"
    STOPPED = "its batch was stopped before its answer ended"
    GIVEN_UP_BEFORE = "its caller gave it up (DELETE) before it arrived"


_GONE_CODES: Final = tuple(Gone)
_SALT: Final = secrets.token_bytes(16)
"""Drawn once per process: nobody outside can make two keys share a digest on purpose."""


def key_digest(key: str) -> int:
    """A key as 64 bits. Two keys sharing one can only refuse a new key (a 410 for a key that
    never ran, about one in 10^13 at the most keys remembered), never run one again."""
    hashed = hashlib.blake2b(key.encode("ascii"), digest_size=8, key=_SALT).digest()
    return int.from_bytes(hashed, "big")


class RanKeys:
    """Digests of the keys whose batches ran here, at about nine bytes each, the last
    ``capacity`` of them at least: recent ones in a dict, older ones in sorted segments of
    ``segment`` keys, the oldest segment dropped whole once more than ``capacity`` are held.
    Only :meth:`add` — a batch that ran — adds one."""

    def __init__(self, capacity: int, segment: int) -> None:
        self._capacity, self._segment = capacity, segment
        self._recent: dict[int, Gone] = {}
        self._segments: collections.deque[tuple[array.array[int], bytes]] = collections.deque()
        """Oldest first: (sorted digests, their reasons' codes), each of ``segment`` keys."""

    def __len__(self) -> int:
        return len(self._recent) + sum(len(digests) for digests, _ in self._segments)

    def add(self, key: str, why: Gone) -> None:
        self._recent[key_digest(key)] = why
        if len(self._recent) < self._segment:
            return
        ordered = sorted(self._recent.items())
        digests = array.array("Q", (digest for digest, _ in ordered))
        reasons = bytes(_GONE_CODES.index(why) for _, why in ordered)
        self._segments.append((digests, reasons))
        self._recent = {}
        while len(self) > self._capacity and self._segments:
            self._segments.popleft()

    def why(self, key: str) -> Gone | None:
        digest = key_digest(key)
        found = self._recent.get(digest)
        if found is not None:
            return found
        for digests, reasons in reversed(self._segments):  # the newest first
            at = bisect.bisect_left(digests, digest)
            if at < len(digests) and digests[at] == digest:
                return _GONE_CODES[reasons[at]]
        return None


class GivenUpKeys:
    """Keys a ``DELETE`` named before any POST under them arrived, each remembered for
    ``lifetime_s`` (a POST held that long in a proxy is refused, never run), at most
    ``capacity`` at once; a ``DELETE`` that would need one more is refused, never room made."""

    def __init__(self, capacity: int, lifetime_s: float) -> None:
        self._capacity, self._lifetime_s = capacity, lifetime_s
        self._until: collections.OrderedDict[int, float] = collections.OrderedDict()
        """Digest -> when it is forgotten; in that order (one lifetime for all)."""

    def __len__(self) -> int:
        return len(self._until)

    def holds(self, key: str, now: float) -> bool:
        self._forget(now)
        return key_digest(key) in self._until

    def add(self, key: str, now: float) -> None:
        """Remember ``key``; raises ``host_busy`` when ``capacity`` are remembered already."""
        self._forget(now)
        if len(self._until) >= self._capacity:
            first = next(iter(self._until.values()))
            raise WireError(
                ErrorCode.HOST_BUSY,
                f"this host already remembers {self._capacity} keys given up before they "
                "arrived, and cannot promise to refuse one more: the request under it may "
                f"still arrive and run here; the oldest is forgotten in {first - now:.0f} s",
                headers=[("retry-after", str(max(1, round(first - now))))],
            )
        self._until[key_digest(key)] = now + self._lifetime_s

    def _forget(self, now: float) -> None:
        while self._until:
            digest, until = next(iter(self._until.items()))
            if until > now:
                return
            del self._until[digest]


class KeyMemory:
    """Every key that runs nothing here any more, and why."""

    def __init__(
        self,
        *,
        lifetime_s: float,
        ran_capacity: int = 1 << 20,
        ran_segment: int = 1 << 14,
        given_up_capacity: int = 1 << 16,
    ) -> None:
        self.ran = RanKeys(ran_capacity, ran_segment)
        self.given_up = GivenUpKeys(given_up_capacity, lifetime_s)

    def why(self, key: str, now: float) -> Gone | None:
        if self.given_up.holds(key, now):
            return Gone.GIVEN_UP_BEFORE
        return self.ran.why(key)
