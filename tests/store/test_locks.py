"""KeyLocks, the Redis store's per-key queues: one holder a key, first come first served, nothing left behind,
and a waiter cancelled (or timed out) at any point neither keeps nor loses a key."""

from __future__ import annotations

import asyncio

import pytest

from rendezvous.store.redis.locks import KeyLocks


async def _holder(locks: KeyLocks, keys: list[str], order: list[str], name: str, go: asyncio.Event) -> None:
    async with locks.hold_all(keys):
        order.append(name)
        await go.wait()


async def test_a_key_has_one_holder_at_a_time_and_waiters_take_it_in_arrival_order() -> None:
    locks, order, go = KeyLocks(), list[str](), asyncio.Event()
    first = asyncio.create_task(_holder(locks, ["b", "a"], order, "first", go))
    await asyncio.sleep(0)
    assert order == ["first"] and len(locks) == 2
    waiting = [asyncio.create_task(_holder(locks, ["a"], order, f"w{i}", go)) for i in range(3)]
    other = asyncio.create_task(_holder(locks, ["c"], order, "other", go))
    for _ in range(3):
        await asyncio.sleep(0)
    assert order == ["first", "other"]  # c was free; a is still held
    go.set()
    await asyncio.gather(first, *waiting, other)
    assert order == ["first", "other", "w0", "w1", "w2"] and len(locks) == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_the_key_goes_to_the_next() -> None:
    locks, order, go = KeyLocks(), list[str](), asyncio.Event()
    first = asyncio.create_task(_holder(locks, ["c"], order, "first", go))
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(_holder(locks, ["c", "b"], order, "cancelled", go))
    last = asyncio.create_task(_holder(locks, ["b"], order, "last", go))
    await asyncio.sleep(0)
    # cancelled took b (free, first in key order) and waits for c, so last waits for b.
    assert order == ["first"] and len(locks) == 2
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await asyncio.sleep(0)
    assert order == ["first", "last"]  # b was given back
    go.set()
    await asyncio.gather(first, last)
    assert len(locks) == 0
    async with locks.hold("c"):  # c's queue held only the cancelled waiter: the key is free
        assert len(locks) == 1


async def test_a_waiter_cancelled_as_the_key_is_handed_to_it_passes_it_on() -> None:
    locks, order, go = KeyLocks(), list[str](), asyncio.Event()
    async with locks.hold("a"):
        unlucky = asyncio.create_task(_holder(locks, ["a"], order, "unlucky", go))
        next_one = asyncio.create_task(_holder(locks, ["a"], order, "next", go))
        await asyncio.sleep(0)
    unlucky.cancel()  # after the release handed it the key, before it ran
    with pytest.raises(asyncio.CancelledError):
        await unlucky
    await asyncio.sleep(0)
    assert order == ["next"]
    go.set()
    await next_one
    assert len(locks) == 0


async def test_a_timeout_while_waiting_releases_what_was_taken() -> None:
    locks, go = KeyLocks(), asyncio.Event()
    async with locks.hold("b"):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                async with locks.hold_all(["a", "b", "c"]):
                    raise AssertionError("b is held")
        assert len(locks) == 1  # a was taken and given back; c never was
    assert len(locks) == 0
    go.set()
