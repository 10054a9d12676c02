"""An engine's KV index entry ends with its incarnation on every backend, even when a report or snapshot races
that end: a call checked against the live engine, whose write lands after the end dropped the entry, must not
leave an entry of the ended incarnation behind (routers would be told a dead engine holds blocks)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from rendezvous.clients.testing import FakeClock
from rendezvous.coordinator import Coordinator
from rendezvous.core import Limits, RendezvousError, Role, Timeouts
from rendezvous.protocol.cache_index import BlockHashing, BlocksStored, CacheReport, CacheSnapshot, PrefixQuery
from rendezvous.protocol.errors import Reason
from rendezvous.store import MemoryStore, Store
from rendezvous.store.redis import RedisStore
from tests.core.helpers import START, engine_spec
from tests.redis_fixtures import fresh_prefix, with_prefix

HASHING = BlockHashing("sha256", "0", 16)
TIMEOUTS = Timeouts(default_lease_ttl=300, max_lease_ttl=300)
CHAIN = (b"a", b"b", b"c")


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    redis = RedisStore(with_prefix(request.getfixturevalue("redis_url"), fresh_prefix()))
    await redis.open()
    yield redis
    await redis.close()


def end_at_the_read(store: Store, end: Callable[[], Awaitable[Any]], after: bool) -> None:
    """Run end once, at the next index read: the call has checked the engine; before it reads the entry (its write
    then lands on no entry) or after (its write then finds the entry changed and reads again)."""
    index = store.index()
    read = index.read
    ended: list[bool] = []

    async def read_and_end(engine_id: str, members: Any) -> Any:
        if not ended and not after:
            ended.append(True)
            await end()
        seen = await read(engine_id, members)
        if not ended:
            ended.append(True)
            await end()
        return seen

    index.read = read_and_end  # type: ignore[method-assign]


async def reported(coord: Coordinator) -> dict[str, int]:
    return {m.engine_id: m.incarnation for m in await coord.index.match(PrefixQuery(CHAIN))}


@pytest.mark.parametrize("call", ["report", "snapshot"])
@pytest.mark.parametrize("ending", ["deregister", "reregister"])
@pytest.mark.parametrize("after", [False, True], ids=["before-read", "after-read"])
async def test_a_call_that_races_the_end_of_its_incarnation_leaves_no_entry(
    store: Store, call: str, ending: str, after: bool
) -> None:
    coord = Coordinator(store, Limits(), TIMEOUTS, clock=FakeClock(START))
    spec = engine_spec("e0", Role.PRODUCER, owner="a")
    first, _ = await coord.register_engine(spec)
    await coord.index.report(CacheReport("e0", 1, (BlocksStored(CHAIN[:1]),), HASHING, first.incarnation))

    async def end() -> None:
        if ending == "deregister":
            await coord.deregister_engine("e0", first.incarnation)
        else:
            await coord.register_engine(spec)

    end_at_the_read(store, end, after)
    with pytest.raises(RendezvousError) as caught:
        if call == "report":
            await coord.index.report(CacheReport("e0", 2, (BlocksStored(CHAIN),), HASHING, first.incarnation))
        else:
            await coord.index.replace(CacheSnapshot("e0", 2, HASHING, ((0, CHAIN),), first.incarnation))
    expected = Reason.LEASE_EXPIRED if ending == "deregister" else Reason.STALE_INCARNATION
    assert caught.value.reason == expected
    assert await reported(coord) == {}
    assert await store.index().total() == 0
