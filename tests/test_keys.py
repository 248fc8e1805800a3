"""``Idempotency-Key`` against any input: a key is the bytes sent, from a closed alphabet; a key
that ran is never run again, whatever else arrives; what remembers keys is bounded, and keys that
never ran cannot push out one that did. In-memory streams on a virtual clock, every time exact."""

from __future__ import annotations

import pytest
import trio

from tests.helpers import CountingRunner, exchange, request_bytes
from tests.test_reattach import KEY, batch, keyed, keyed_host
from trio_gym.errors import ErrorCode, WireError
from trio_gym.host.keys import GivenUpKeys, Gone, KeyMemory, RanKeys
from trio_gym.protocol.host_identity import HOST_IDENTITY_HEADER


def raw_keyed(key: bytes, body: bytes = b'{"examples": [{"seed": 1, "meetings": 1}]}') -> bytes:
    """A POST whose key is these bytes exactly (``request_bytes`` would encode text)."""
    head = (
        b"POST /rollouts/run HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n"
        b"Idempotency-Key: %s\r\n\r\n" % (len(body), key)
    )
    return head + body


async def test_an_expired_key_stays_refused_after_any_number_of_deletes_and_posts_of_other_keys(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Found by an adversarial run: 4,200 DELETEs of made-up keys pushed an expired key out of
    one list of 4,096, and the same POST then ran again. A host without an identity takes a
    DELETE from anyone: those keys are remembered apart from the keys that ran."""
    runner = CountingRunner()
    async with keyed_host(runner, answer_retention_s=10, reattach_grace_s=5) as (host, connect):
        first = await exchange(connect(), keyed(batch(think_s=1)))
        await trio.sleep(20)  # past its retention
        expired = await exchange(connect(), keyed(batch(think_s=1)))
        for n in range(4200):
            deleted = request_bytes(method="DELETE", headers=[("Idempotency-Key", f"made-up-{n}")])
            assert (await exchange(connect(), deleted)).status == 200
        for n in range(300):
            other = await exchange(connect(), keyed(batch(count=1, think_s=0.1), f"other-{n}"))
            assert other.status == 200
        again = await exchange(connect(), keyed(batch(think_s=1)))
    assert first.status == 200 and expired.status == 410 and again.status == 410
    assert again.json()["error"]["code"] == "answer_expired"
    assert len(runner.started) == 2 + 300  # the key's two examples ran once


async def test_a_host_with_an_identity_takes_no_delete_and_remembers_nothing_from_a_stranger(
    autojump_clock: trio.abc.Clock,
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner, host_identity="ours") as (host, connect):
        refused = [
            await exchange(connect(), request_bytes(method="DELETE", headers=headers))
            for headers in (
                [("Idempotency-Key", "k")],
                [("Idempotency-Key", "k"), (HOST_IDENTITY_HEADER, "")],
            )
        ]
        taken = await exchange(
            connect(),
            request_bytes(
                method="DELETE", headers=[("Idempotency-Key", "k"), (HOST_IDENTITY_HEADER, "ours")]
            ),
        )
    assert [reply.status for reply in refused] == [403, 403]
    assert taken.status == 200 and taken.json() == {"key": "k", "cancelled": False}
    assert len(host.services.keyed.memory.given_up) == 1  # the holder's, and only it


def test_a_delete_that_cannot_be_remembered_is_refused_and_evicts_nothing() -> None:
    """A DELETE answered 200 is a promise that the POST still on its way will be refused: the
    host gives it only while it has room, and frees room only as keys age out."""
    given_up = GivenUpKeys(capacity=3, lifetime_s=600)
    for key in ("a", "b", "c"):
        given_up.add(key, now=0)
    with pytest.raises(WireError) as refused:
        given_up.add("d", now=100)
    assert refused.value.code is ErrorCode.HOST_BUSY
    assert ("retry-after", "500") in refused.value.headers
    assert all(given_up.holds(key, now=100) for key in ("a", "b", "c"))
    assert not given_up.holds("d", now=100)
    given_up.add("d", now=600)  # "a", "b" and "c" have aged out
    assert given_up.holds("d", now=600) and not given_up.holds("a", now=600)


def test_keys_that_ran_are_forgotten_oldest_first_and_only_as_more_keys_run() -> None:
    ran = RanKeys(capacity=4, segment=2)
    reasons = [Gone.EXPIRED, Gone.STOPPED, Gone.GIVEN_UP, Gone.EXPIRED, Gone.STOPPED, Gone.EXPIRED]
    for n, why in enumerate(reasons):
        ran.add(f"k{n}", why)
    assert [ran.why(f"k{n}") for n in range(6)] == [None, None, *reasons[2:]]
    assert ran.why("never-ran") is None and len(ran) == 4


def test_key_memory_tells_a_key_given_up_before_it_arrived_from_one_that_ran() -> None:
    memory = KeyMemory(lifetime_s=600)
    memory.given_up.add("early", now=0)
    memory.ran.add("done", Gone.EXPIRED)
    assert memory.why("early", now=1) is Gone.GIVEN_UP_BEFORE
    assert memory.why("done", now=1) is Gone.EXPIRED
    assert memory.why("new", now=1) is None


@pytest.mark.parametrize(
    "key",
    [
        b"acc-\xe9t\xe9-key",  # latin-1
        "acc-été-key".encode(),  # UTF-8
        b"acc key",
        b"acc\x7fkey",
        b"acc\x01key",
        b"k" * 256,
    ],
    ids=["latin-1", "utf-8", "space", "del", "control", "256-bytes"],
)
async def test_a_key_outside_visible_ascii_is_refused_naming_the_rule_never_its_bytes(
    autojump_clock: trio.abc.Clock, key: bytes
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner) as (host, connect):
        refused = await exchange(connect(), raw_keyed(key))
    error = refused.json()["error"]
    assert refused.status == 400 and error["code"] == "invalid_request"
    assert "visible ASCII" in error["message"] and "acc" not in error["message"]
    assert not runner.started


@pytest.mark.parametrize(
    ("one", "other", "status"),
    [(b"acc-X-key", b"acc-Y-key", 200), (b"acc-\xe9t\xe9-key", b"acc-\xe8t\xe8-key", 400)],
    ids=["visible-ascii", "beyond-ascii"],
)
async def test_two_keys_that_differ_in_one_byte_are_two_keys_or_both_refused(
    autojump_clock: trio.abc.Clock, one: bytes, other: bytes, status: int
) -> None:
    """Found by an adversarial run: bytes decoded lossily made two keys one, and the second
    was refused as the first's (422)."""
    runner = CountingRunner()
    async with keyed_host(runner) as (host, connect):
        first = await exchange(connect(), raw_keyed(one))
        second = await exchange(connect(), raw_keyed(other, b'{"examples": [{"seed": 2}]}'))
    assert (first.status, second.status) == (status, status)
    assert len(runner.started) == (2 if status == 200 else 0)


@pytest.mark.parametrize("key", ["acc\\back\\slash", 'it\'s-"quoted"', "plain-key"])
async def test_a_refusal_quotes_the_key_as_it_was_sent(
    autojump_clock: trio.abc.Clock, key: str
) -> None:
    runner = CountingRunner()
    async with keyed_host(runner) as (host, connect), trio.open_nursery() as nursery:
        nursery.start_soon(exchange, connect(), keyed(batch(), key))
        await runner.wait_for(lambda r: len(r.started) == 2)
        reused = await exchange(connect(), keyed(batch(count=3), key))
        nursery.cancel_scope.cancel()
    assert reused.status == 422
    assert f"Idempotency-Key: {key} belongs to another request" in reused.json()["error"]["message"]


async def test_a_key_given_twice_is_refused(autojump_clock: trio.abc.Clock) -> None:
    runner = CountingRunner()
    async with keyed_host(runner) as (host, connect):
        twice = request_bytes(batch(), headers=[("Idempotency-Key", KEY), ("Idempotency-Key", KEY)])
        refused = await exchange(connect(), twice)
    assert refused.status == 400 and "given 2 times" in refused.json()["error"]["message"]
    assert not runner.started
