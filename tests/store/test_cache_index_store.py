"""The IndexStore contract (rendezvous/store/cache_index.py), the same on every backend: compare-and-set on an
engine's entry, the server's block bound, queries, drops by incarnation; replicas share one index."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from rendezvous.core.cache_index import IndexEntry, IndexWrite, member
from rendezvous.core.model import Role
from rendezvous.protocol.cache_index import BlockHashing, PrefixQuery
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.store.base import Store
from rendezvous.store.cache_index import IndexBounds
from tests.store.conftest import StoreFactory
from tests.store.test_credits_store import replicas

HASHING = BlockHashing("sha256", "seed", 16, integer_hashes=True)
BIG = IndexBounds(1_000_000, 1_000_000)


def entry(
    engine_id: str,
    sequence: int,
    count: int,
    incarnation: int = 7,
    pool: str = "p",
    role: Role = Role.PRODUCER,
    owner: str = "",
) -> IndexEntry:
    return IndexEntry(engine_id, incarnation, pool, role, sequence, HASHING, count, owner)


def put(e: IndexEntry, *hashes: bytes, reset: bool = False, removes: tuple[bytes, ...] = ()) -> IndexWrite:
    return IndexWrite(e, reset, frozenset(member(0, h) for h in hashes), frozenset(member(0, h) for h in removes))


async def test_write_is_compare_and_set_on_the_entry(make_store: StoreFactory, backend: str) -> None:
    one, two = await replicas(make_store, backend, 2)
    a, b = one.index(), two.index()
    first = entry("e0", 1, 2)
    assert await a.write(None, put(first, b"x", b"y"), BIG)
    # The other replica decided on "no entry" too: refused, nothing written.
    assert not await b.write(None, put(entry("e0", 1, 1), b"z"), BIG)
    seen = await b.read("e0", [member(0, b"x"), member(0, b"z"), member(1, b"x")])
    assert seen.entry == first
    assert list(seen.held.values()) == [True, False, False]
    assert await b.write(seen, put(entry("e0", 2, 2), b"z", removes=(b"y",)), BIG)
    assert (await a.read("e0", [member(0, b"y"), member(0, b"z")])).held == {
        member(0, b"y"): False,
        member(0, b"z"): True,
    }
    assert await a.total() == 2


async def test_every_write_moves_the_version_a_snapshot_at_the_same_sequence_too(
    make_store: StoreFactory, backend: str
) -> None:
    """A snapshot may carry the entry's own sequence: it replaces the set without moving the sequence, so a report
    decided on the set before it must still be refused, or its count and the totals drift from the sets."""
    one, two = await replicas(make_store, backend, 2)
    a, b = one.index(), two.index()
    assert await a.write(None, put(entry("e0", 5, 4), b"a", b"b", b"c", b"d"), BIG)
    before = await b.read("e0", [member(0, b"a"), member(0, b"b")])
    # A snapshot at sequence 5 again: the entry's incarnation and sequence stay, its set does not.
    assert await a.write(await a.read("e0", []), put(entry("e0", 5, 2), b"x", b"y", reset=True), BIG)
    after = await b.read("e0", [])
    assert after.entry == entry("e0", 5, 2) and after.version != before.version
    # A report decided on the old set (removing a and b: 2 blocks left, it thinks) is refused; nothing moves.
    assert not await b.write(before, put(entry("e0", 6, 2), removes=(b"a", b"b")), BIG)
    assert (await b.read("e0", [])).entry == entry("e0", 5, 2)
    assert await b.total() == 2
    # The same report decided again on the read after the snapshot writes.
    assert await b.write(after, put(entry("e0", 6, 2)), BIG)
    assert (await a.read("e0", [])).version not in (before.version, after.version)


async def test_racing_writes_on_one_entry_let_one_win(make_store: StoreFactory, backend: str) -> None:
    stores = await replicas(make_store, backend, 3)
    won = await asyncio.gather(*(s.index().write(None, put(entry("e0", 1, 1), b"a"), BIG) for s in stores))
    assert sorted(w is not None for w in won) == [False, False, True]


async def test_a_reset_replaces_the_blocks_and_the_total_follows(store: Store) -> None:
    index = store.index()
    first = entry("e0", 1, 3)
    assert await index.write(None, put(first, b"a", b"b", b"c"), BIG)
    assert await index.write(await index.read("e0", []), put(entry("e0", 2, 1), b"d", reset=True), BIG)
    held = (await index.read("e0", [member(0, h) for h in (b"a", b"d")])).held
    assert list(held.values()) == [False, True]
    assert await index.total() == 1


async def test_the_server_bound_refuses_growth_past_it(store: Store) -> None:
    index, bounds = store.index(), IndexBounds(3, 100)
    assert await index.write(None, put(entry("e0", 1, 2), b"a", b"b"), bounds)
    with pytest.raises(RendezvousError) as caught:
        await index.write(None, put(entry("e1", 1, 2), b"a", b"b"), bounds)
    assert caught.value.reason == Reason.INDEX_FULL
    assert caught.value.metadata == {"scope": "server", "limit": "3", "have": "2", "adding": "2"}
    assert (await index.read("e1", [])).entry is None
    assert await index.write(None, put(entry("e1", 1, 1), b"a"), bounds)


async def test_an_identity_bound_counts_its_engines_together(make_store: StoreFactory, backend: str) -> None:
    one, two = await replicas(make_store, backend, 2)
    bounds = IndexBounds(100, 3)
    a0, a1, b0 = entry("a0", 1, 2, owner="a"), entry("a1", 1, 2, owner="a"), entry("b0", 1, 3, owner="b")
    assert await one.index().write(None, put(a0, b"x", b"y"), bounds)
    with pytest.raises(RendezvousError) as caught:
        await two.index().write(None, put(a1, b"x", b"y"), bounds)
    assert caught.value.metadata == {"scope": "identity", "limit": "3", "have": "2", "adding": "2"}
    # Another identity has its own bound; an engine without an owner (no auth) is bounded by the server's only.
    assert await two.index().write(None, put(b0, b"x", b"y", b"z"), bounds)
    assert await two.index().write(None, put(entry("n0", 1, 4), b"p", b"q", b"r", b"s"), bounds)
    # Rewriting an entry charges its new size, less what it held: a0 grows to 3, then its blocks go with it.
    assert await one.index().write(await one.index().read("a0", []), put(entry("a0", 2, 3, owner="a"), b"z"), bounds)
    assert await one.index().drop("a0", 7)
    assert await two.index().write(None, put(a1, b"x", b"y"), bounds)


def snapshot(e: IndexEntry, *hashes: bytes) -> IndexWrite:
    """A snapshot's write: reset, its blocks in the order to keep, cut by a bound with no room for all of them."""
    return IndexWrite(e, True, tuple(member(0, h) for h in hashes), frozenset(), cut=True)


@pytest.mark.parametrize("scope", ["server", "identity"])
async def test_a_snapshot_past_a_bound_keeps_its_leading_blocks_and_none_of_the_old(
    make_store: StoreFactory, backend: str, scope: str
) -> None:
    """A snapshot the server's or its identity's bound has no room for is cut to its leading blocks (never fewer
    than the entry held), not refused: refused, the entry kept its old blocks, ones the engine no longer holds, and
    routers were sent to them. A report past the same bound is still refused."""
    one, two = await replicas(make_store, backend, 2)
    bounds = IndexBounds(4, 100) if scope == "server" else IndexBounds(100, 4)
    assert await one.index().write(None, put(entry("a0", 1, 2, owner="a"), b"x", b"y"), bounds)
    assert await one.index().write(None, put(entry("a1", 1, 1, owner="a"), b"old"), bounds)
    read = await two.index().read("a1", [])
    written = await two.index().write(read, snapshot(entry("a1", 2, 4, owner="a"), b"p", b"q", b"r", b"s"), bounds)
    assert written is not None
    assert written.entry == entry("a1", 2, 2, owner="a")  # room for 2 of its 4 blocks: the 1 it held and 1 more
    assert written.cut_by == scope  # which bound: shared with the identity's or the server's other engines
    held = (await one.index().read("a1", [member(0, h) for h in (b"old", b"p", b"q", b"r")])).held
    assert list(held.values()) == [False, True, True, False]
    assert [m.matched_blocks for m in await one.index().match(PrefixQuery((b"old",), engine_ids=("a1",)))] == [0]
    assert (await one.index().total(), (await two.index().read("a1", [])).entry) == (4, written.entry)
    # No room at all: it keeps as many as it held (shrinking is always allowed), here the first 2.
    read = await one.index().read("a1", [])
    kept = await one.index().write(read, snapshot(entry("a1", 3, 3, owner="a"), b"s", b"t", b"u"), bounds)
    assert kept is not None and (kept.entry, kept.cut_by) == (entry("a1", 3, 2, owner="a"), scope)
    # One that fits is written whole: no bound cut it.
    whole = await one.index().write(
        await one.index().read("a1", []), snapshot(entry("a1", 4, 1, owner="a"), b"s"), bounds
    )
    assert whole is not None and (whole.entry, whole.cut_by) == (entry("a1", 4, 1, owner="a"), "")
    with pytest.raises(RendezvousError) as caught:
        await one.index().write(await one.index().read("a1", []), put(entry("a1", 5, 3, owner="a"), b"t", b"v"), bounds)
    assert caught.value.metadata["scope"] == scope


async def test_match_counts_leading_blocks_per_selected_engine(store: Store) -> None:
    index = store.index()
    await index.write(None, put(entry("e0", 1, 3), b"a", b"b", b"d"), BIG)
    await index.write(None, put(entry("e1", 1, 1, pool="q", role=Role.CONSUMER), b"a"), BIG)
    await index.write(None, put(entry("e2", 1, 1), b"z"), BIG)
    chain = (b"a", b"b", b"c", b"d")
    found = await index.match(PrefixQuery(chain))
    assert [(m.engine_id, m.matched_blocks) for m in found] == [("e0", 2), ("e1", 1), ("e2", 0)]
    assert found[0].hashing == HASHING and (found[0].pool, found[0].role, found[0].sequence) == ("p", Role.PRODUCER, 1)
    assert [m.engine_id for m in await index.match(PrefixQuery(chain, pools=("q",)))] == ["e1"]
    assert [m.engine_id for m in await index.match(PrefixQuery(chain, role=Role.PRODUCER))] == ["e0", "e2"]
    assert [m.engine_id for m in await index.match(PrefixQuery(chain, engine_ids=("e2", "nope", "e2")))] == ["e2"]
    several = PrefixQuery(chain, engine_ids=("e2", "e1", "nope", "e0"))  # several ids, narrowed by pools and role
    assert [m.engine_id for m in await index.match(several)] == ["e0", "e1", "e2"]
    assert [m.engine_id for m in await index.match(replace(several, pools=("p", "x")))] == ["e0", "e2"]
    assert [m.engine_id for m in await index.match(replace(several, role=Role.CONSUMER))] == ["e1"]
    assert [m.matched_blocks for m in await index.match(PrefixQuery(chain, group=1))] == [0, 0, 0]
    # Only the engines holding at least min_matched leading blocks.
    assert [m.engine_id for m in await index.match(PrefixQuery(chain, min_matched=1))] == ["e0", "e1"]
    assert await index.match(PrefixQuery(chain, min_matched=3)) == []


async def test_drop_takes_an_incarnation_and_older_ones_only(make_store: StoreFactory, backend: str) -> None:
    one, two = await replicas(make_store, backend, 2)
    await one.index().write(None, put(entry("e0", 1, 2, incarnation=7), b"a", b"b"), BIG)
    assert not await two.index().drop("e0", 6)
    assert [m.engine_id for m in await two.index().match(PrefixQuery((b"a",)))] == ["e0"]
    assert await two.index().drop("e0", 7)
    assert not await two.index().drop("e0", 7)
    assert await one.index().match(PrefixQuery((b"a",))) == []
    assert (await one.index().read("e0", [member(0, b"a")])).held == {member(0, b"a"): False}
    assert await one.index().total() == 0
