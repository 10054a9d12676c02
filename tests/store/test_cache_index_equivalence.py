"""The KV index on Redis answers as on the memory store, and both as plain sets: random reports, snapshots,
engine ends and queries (narrowed by engine ids, pools and role) through the coordinator give the same answers on
both stores, a refused batch leaves no trace, and a query counts exactly the leading blocks the engine's accepted
events leave it holding (never one it reported removed). The bounds (per engine, per identity, in all) are small
enough for the operations to reach."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rendezvous.clients.testing import FakeClock
from rendezvous.coordinator import Coordinator
from rendezvous.core import Limits, RendezvousError, Role, Timeouts
from rendezvous.protocol.cache_index import (
    AllBlocksCleared,
    BlockHashing,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheReport,
    CacheSnapshot,
    IndexPosition,
    PrefixQuery,
)
from rendezvous.store import MemoryStore, Store
from rendezvous.store.redis import RedisStore
from tests.ci import examples
from tests.core.helpers import START, engine_spec
from tests.redis_fixtures import fresh_prefix, with_prefix

pytestmark = pytest.mark.redis

ENGINES = {"e0": Role.PRODUCER, "e1": Role.CONSUMER}
HASHING = BlockHashing("sha256", "0", 16)
LIMITS = Limits(max_index_blocks_per_engine=5, max_index_blocks_total=8, max_index_blocks_per_identity=7)
OWNER = "a"
"""The identity both engines are registered by: their entries share its bound."""
TIMEOUTS = Timeouts(default_lease_ttl=300, max_lease_ttl=300)

block = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"f"])
blocks = st.lists(block, min_size=1, max_size=3).map(tuple)
group = st.integers(0, 1)
event = st.one_of(
    st.builds(BlocksStored, blocks, st.one_of(st.just(b""), block), group),
    st.builds(BlocksRemoved, blocks, group),
    st.just(AllBlocksCleared()),
)
engine = st.sampled_from(sorted(ENGINES))
operation = st.one_of(
    # The sequence as an offset from the one after the last applied: 0 is the next, -1 a duplicate, more a gap.
    st.tuples(st.just("report"), engine, st.sampled_from([0, 0, 0, -1, -2, 1]), st.lists(event, max_size=4),
              st.booleans()),
    st.tuples(st.just("snapshot"), engine, st.sampled_from([0, 2, -2]), st.lists(st.tuples(group, blocks),
              max_size=2)),
    st.tuples(st.just("end"), engine),
    st.tuples(st.just("match"), blocks, group, st.integers(0, 2), st.sampled_from([(), ("e0",), ("e1", "e0", "x")]),
              st.sampled_from([(), ("prefill",), ("decode", "nowhere")]), st.sampled_from([None, *ENGINES.values()])),
)  # fmt: skip
POOLS = {"e0": "prefill", "e1": "decode"}
"""The pools engine_spec puts the engines in (by role)."""


@dataclass
class Model:
    """What the engines' accepted events leave them holding: plain sets, by engine."""

    held: dict[str, set[tuple[int, bytes]]] = field(default_factory=dict)
    sequence: dict[str, int] = field(default_factory=dict)

    def next_sequence(self, engine_id: str, offset: int) -> int:
        return max(self.sequence.get(engine_id, -1) + 1 + offset, 0)

    def apply(self, engine_id: str, events: list[CacheEvent]) -> None:
        held = self.held.setdefault(engine_id, set())
        for e in events:
            match e:
                case BlocksStored():
                    held.update((e.group, h) for h in e.block_hashes)
                case BlocksRemoved():
                    held.difference_update((e.group, h) for h in e.block_hashes)
                case AllBlocksCleared():
                    held.clear()

    def matched(self, chain: tuple[bytes, ...], g: int) -> dict[str, int]:
        found = {}
        for engine_id, held in self.held.items():
            n = 0
            while n < len(chain) and (g, chain[n]) in held:
                n += 1
            found[engine_id] = n
        return found


async def apply(coord: Coordinator, model: Model, op: tuple[Any, ...]) -> Any:
    """One operation on one store; its answer, errors reduced to their reason. The model is not changed."""
    kind, *args = op
    try:
        if kind == "report":
            engine_id, offset, events, hashing = args
            report = CacheReport(
                engine_id, model.next_sequence(engine_id, offset), tuple(events), HASHING if hashing else None
            )
            return await coord.index.report(report)
        if kind == "snapshot":
            engine_id, offset, groups = args
            snapshot = CacheSnapshot(engine_id, model.next_sequence(engine_id, offset), HASHING, tuple(groups))
            return await coord.index.replace(snapshot)
        if kind == "end":
            await coord.deregister_engine(args[0], 0)
            return await coord.register_engine(engine_spec(args[0], ENGINES[args[0]], owner=OWNER))
        chain, g, least, ids, pools, role = args
        found = await coord.index.match(PrefixQuery(chain, g, pools, ids, role, least))
        return {m.engine_id: m.matched_blocks for m in found}
    except RendezvousError as err:
        return err.reason


def follow(model: Model, op: tuple[Any, ...], answer: Any) -> None:
    """Move the model as the answer says the service did."""
    kind, *args = op
    if kind == "match":
        chain, g, least, ids, pools, role = args
        assert answer == {
            e: n
            for e, n in model.matched(chain, g).items()
            if n >= least and (not ids or e in ids) and (not pools or POOLS[e] in pools) and role in (None, ENGINES[e])
        }
    elif kind == "end":
        model.held.pop(args[0], None)
        model.sequence.pop(args[0], None)
    elif not isinstance(answer, str) and not answer.duplicate:
        engine_id = args[0]
        if kind == "snapshot":
            # Past max_index_blocks_per_engine, or the room the server's and the identity's bounds leave it (both
            # engines are one identity's; never fewer than it held), a snapshot keeps its first distinct blocks in
            # the order sent.
            sent = list(dict.fromkeys((g, h) for g, hashes in args[2] for h in hashes))
            before = len(model.held.get(engine_id, ()))
            others = sum(len(h) for e, h in model.held.items() if e != engine_id)
            room = max(before, min(LIMITS.max_index_blocks_total, LIMITS.max_index_blocks_per_identity) - others)
            model.held[engine_id] = set(sent[: min(LIMITS.max_index_blocks_per_engine, room)])
            assert answer.left_out == len(sent) - len(model.held[engine_id])
        else:
            model.apply(engine_id, args[2])
        model.sequence[engine_id] = answer.sequence
        assert answer.block_count == len(model.held[engine_id])


async def compare(redis_url: str, ops: list[tuple[Any, ...]]) -> None:
    memory = MemoryStore()
    redis = RedisStore(with_prefix(redis_url, fresh_prefix()))
    await redis.open()
    stores: list[Store] = [memory, redis]
    try:
        coords = [Coordinator(s, LIMITS, TIMEOUTS, clock=FakeClock(START)) for s in stores]
        for engine_id, role in ENGINES.items():
            for coord in coords:
                await coord.register_engine(engine_spec(engine_id, role, owner=OWNER))
        model = Model()
        for op in ops:
            answers = [await apply(coord, model, op) for coord in coords]
            assert answers[0] == answers[1], op
            follow(model, op, answers[0])
        totals = [await s.index().total() for s in stores]
        assert totals == [sum(len(h) for h in model.held.values())] * 2
    finally:
        await redis.close()


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(operation, min_size=1, max_size=30))
# A chain stored, a block of it removed, then matched: the count stops at the hole.
@example(
    ops=[
        ("report", "e0", 0, [BlocksStored((b"a", b"b", b"c"))], True),
        ("report", "e0", 0, [BlocksRemoved((b"b",))], False),
        ("match", (b"a", b"b", b"c"), 0, 0, (), (), None),
    ]
)
def test_random_index_operations_give_the_same_answers_on_memory_and_redis(
    redis_url: str, ops: list[tuple[Any, ...]]
) -> None:
    asyncio.run(compare(redis_url, ops))


async def test_a_report_decided_before_a_same_sequence_snapshot_reads_again(redis_url: str) -> None:
    """Two replicas: a report on one reads the entry, a snapshot at the entry's own sequence lands on the other, then
    the report writes. Its decision was made on the old set, so its write must be refused and decided again: the
    entry's count, the owner's tally and the server's total then match the set."""
    url = with_prefix(redis_url, fresh_prefix())
    stores = [RedisStore(url), RedisStore(url)]
    for s in stores:
        await s.open()
    try:
        one, two = (Coordinator(s, Limits(), TIMEOUTS, clock=FakeClock(START)) for s in stores)
        await one.register_engine(engine_spec("e0", Role.CONSUMER, owner=OWNER))
        old, new = (b"a", b"b", b"c", b"d"), (b"v", b"w", b"x", b"y", b"z")
        await one.index.report(CacheReport("e0", 5, (BlocksStored(old),), HASHING))
        index = stores[0].index()
        read = index.read
        raced: list[IndexPosition] = []

        async def read_then_snapshot(engine_id: str, members: Any) -> Any:
            seen = await read(engine_id, members)
            if members and not raced:  # the report's first read: the snapshot lands before its write
                raced.append(await two.index.replace(CacheSnapshot("e0", 5, HASHING, ((0, new),))))
            return seen

        index.read = read_then_snapshot  # type: ignore[method-assign]
        answer = await one.index.report(CacheReport("e0", 6, (BlocksRemoved(old[:2]),)))
        assert raced and raced[0].block_count == len(new)
        assert answer.block_count == len(new)  # the removed blocks were no longer held
        held = (await stores[1].index().read("e0", [])).entry
        assert held is not None and held.block_count == len(new)
        assert await stores[1].index().total() == len(new)
        found = await two.index.match(PrefixQuery(new))
        assert [(m.engine_id, m.matched_blocks) for m in found] == [("e0", len(new))]
    finally:
        for s in stores:
            await s.close()
