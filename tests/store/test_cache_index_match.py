"""MatchPrefixes' work in the stores (rendezvous.store.cache_index.leading_counts): it gives the event loop back
between steps, looks up at most max_index_query_lookups blocks, and past that cuts every count at the same depth on
every backend, the depth the rule says; on Redis, in script calls of bounded work."""

from __future__ import annotations

import asyncio
from collections.abc import ItemsView, Iterator, ValuesView
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rendezvous import pacing
from rendezvous.core.cache_index import IndexEntry, IndexWrite, member
from rendezvous.core.model import Role
from rendezvous.protocol.cache_index import BlockHashing, PrefixQuery
from rendezvous.store.base import Store
from rendezvous.store.cache_index import MATCH_STEP, IndexBounds, MemoryIndex, leading_counts
from rendezvous.store.redis import RedisStore
from tests.ci import examples
from tests.redis_fixtures import fresh_prefix, with_prefix

HASHING = BlockHashing("sha256", "seed", 16)
BIG = IndexBounds(10_000_000, 10_000_000)


def chain(n: int) -> tuple[bytes, ...]:
    return tuple(i.to_bytes(8, "big") for i in range(1, n + 1))


async def hold(index: Any, engine_id: str, blocks: tuple[bytes, ...]) -> None:
    entry = IndexEntry(engine_id, 1, "p", Role.PRODUCER, 0, HASHING, len(blocks))
    assert await index.write(None, IndexWrite(entry, True, frozenset(member(0, h) for h in blocks), frozenset()), BIG)


def depth_rule(counts: list[int], length: int, budget: int) -> int:
    """The depth a query's lookups reach: the largest D <= length with sum(min(count + 1, D)) <= budget."""
    depth = 0
    while depth < length and sum(min(c + 1, depth + 1) for c in counts) <= budget:
        depth += 1
    return depth


class Watched(set[bytes]):
    """A block set that notes, for each lookup, how many times the other task had run."""

    def __init__(self, blocks: set[bytes], ticks: list[int], seen: list[int]) -> None:
        super().__init__(blocks)
        self.ticks, self.seen = ticks, seen

    def __contains__(self, m: object) -> bool:
        self.seen.append(self.ticks[0])
        return super().__contains__(m)


async def test_a_long_query_gives_the_loop_to_other_tasks_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pacing, "QUANTUM", 0.0)  # yield at every chance, so the test needs no timing
    index = MemoryIndex()
    blocks = chain(4_096)
    ticks, seen = [0], list[int]()
    for i in range(4):
        await hold(index, f"e{i}", blocks)
        index._blocks[f"e{i}"] = Watched(index._blocks[f"e{i}"], ticks, seen)

    async def tick() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    try:
        found = await index.match(PrefixQuery(blocks))
    finally:
        ticker.cancel()
    assert [m.matched_blocks for m in found] == [4_096] * 4
    # 16,384 lookups: without yields they all run in one step of the loop, with no tick between the first and last.
    assert len(seen) == 4 * 4_096
    assert len(set(seen)) >= 4 * 4_096 // MATCH_STEP


async def test_a_query_looks_up_at_most_its_budget_and_cuts_every_count_at_one_depth() -> None:
    index = MemoryIndex()
    blocks = chain(100)
    ticks, seen = [0], list[int]()
    held = {"full0": 100, "full1": 100, "half": 50, "few": 3, "none": 0}
    for engine_id, n in held.items():
        await hold(index, engine_id, blocks[:n])
        index._blocks[engine_id] = Watched(index._blocks[engine_id], ticks, seen)
    exact = {m.engine_id: m.matched_blocks for m in await index.match(PrefixQuery(blocks))}
    assert exact == held and len(seen) == 100 + 100 + 51 + 4 + 1
    seen.clear()
    # 160 lookups: level 0 takes 5, levels 1 to 3 take 4 (17), levels 4 to 50 take 3 (158), level 51 takes 2.
    found = await index.match(PrefixQuery(blocks), max_lookups=160)
    assert {m.engine_id: m.matched_blocks for m in found} == {"full0": 52, "full1": 52, "half": 50, "few": 3, "none": 0}
    assert {m.engine_id for m in found if m.at_least} == {"full0", "full1"}  # they hold 52 or more; the rest exact
    assert depth_rule(list(held.values()), 100, 160) == 52
    assert len(seen) <= 160
    assert not any(m.at_least for m in await index.match(PrefixQuery(blocks)))
    # Too few lookups for one level: every engine counts 0 (and min_matched leaves them all out).
    assert {m.matched_blocks for m in await index.match(PrefixQuery(blocks), max_lookups=4)} == {0}
    assert await index.match(PrefixQuery(blocks, min_matched=1), max_lookups=4) == []


@settings(max_examples=examples(200), deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), max_size=12),
    length=st.integers(1, 40),
    budget=st.integers(0, 600),
    step=st.sampled_from([1, 2, 7, 4_096]),
)
def test_the_depth_is_the_rule_whatever_the_steps(counts: list[int], length: int, budget: int, step: int) -> None:
    counts = [min(c, length) for c in counts]
    probed = [0]

    async def probe(engines: Any, start: int, stop: int) -> list[int]:
        assert len(engines) * (stop - start) <= step  # one step: at most MATCH_STEP lookups
        probed[0] += sum(min(counts[i] - start + 1, stop - start) for i in engines)
        return [min(max(counts[i] - start, 0), stop - start) for i in engines]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("rendezvous.store.cache_index.MATCH_STEP", step)
        got, stopped = asyncio.run(leading_counts(len(counts), length, budget, probe))
    depth = depth_rule(counts, length, budget)
    assert got == [min(c, depth) for c in counts]
    for n, held in zip(got, counts, strict=True):  # `answers` says "at least" exactly where a count may be short
        assert n == held or (stopped < length and n == stopped and held > n)
    assert probed[0] <= budget


class Entries(dict[str, IndexEntry]):
    """The memory index's entries, noting every walk over all of them."""

    def __init__(self, entries: dict[str, IndexEntry], walks: list[str]) -> None:
        super().__init__(entries)
        self.walks = walks

    def __iter__(self) -> Iterator[str]:
        self.walks.append("iter")
        return super().__iter__()

    def values(self) -> ValuesView[IndexEntry]:  # type: ignore[override]
        self.walks.append("values")
        return super().values()

    def items(self) -> ItemsView[str, IndexEntry]:  # type: ignore[override]
        self.walks.append("items")
        return super().items()


async def test_a_query_naming_its_engines_reads_their_entries_only() -> None:
    """A query with engine_ids looks up those entries, each once, instead of testing every entry against every id
    (O(entries x ids): 230 ms a query for 100 ids among 100,000 entries, 0.2 ms looked up)."""
    index = MemoryIndex()
    for i in range(20):
        await hold(index, f"e{i}", chain(i % 4))
    walks: list[str] = []
    index._entries = Entries(index._entries, walks)
    found = await index.match(PrefixQuery(chain(3), engine_ids=("e3", "e5", "nope", "e3", "e4")))
    assert [(m.engine_id, m.matched_blocks) for m in found] == [("e3", 3), ("e5", 1), ("e4", 0)]
    assert walks == []
    assert len(await index.match(PrefixQuery(chain(3)))) == 20 and walks  # none named: every entry


async def test_every_backend_cuts_at_the_same_depth(store: Store) -> None:
    index = store.index()
    blocks = chain(300)
    held = {f"e{i}": n for i, n in enumerate([300, 300, 300, 120, 7, 0, 299])}
    for engine_id, n in held.items():
        await hold(index, engine_id, blocks[:n])
    for budget in (0, 6, 7, 50, 1_000, 1_500, 10_000):
        found = await index.match(PrefixQuery(blocks), max_lookups=budget)
        depth = depth_rule(list(held.values()), 300, budget)
        assert {m.engine_id: m.matched_blocks for m in found} == {e: min(n, depth) for e, n in held.items()}, budget
        # Counted to a depth short of the chain: those that reached it hold at least that many.
        assert {m.engine_id for m in found if m.at_least} == {
            e for e, n in held.items() if depth < 300 and n >= depth
        }, budget


@pytest.mark.redis
async def test_a_long_query_holds_redis_one_bounded_script_at_a_time(redis_url: str) -> None:
    """Redis runs one script at a time for every replica: a query's lookups go in calls of at most MATCH_STEP."""
    store = RedisStore(with_prefix(redis_url, fresh_prefix()))
    await store.open()
    try:
        index = store.index()
        blocks = chain(4_096)
        for i in range(4):
            await hold(index, f"e{i}", blocks)
        await hold(index, "short", blocks[:10])
        scripts = index._scripts  # type: ignore[attr-defined]
        run = scripts.run
        calls: list[tuple[str, int]] = []

        async def counted(name: str, **args: Any) -> Any:
            calls.append((name, len(args.get("members", ())) * len(args.get("engine_ids", ()))))
            return await run(name, **args)

        scripts.run = counted
        found = await index.match(PrefixQuery(blocks))
        assert {m.engine_id: m.matched_blocks for m in found} == {"e0": 4_096, "e1": 4_096, "e2": 4_096, "e3": 4_096,
                                                                   "short": 10}  # fmt: skip
        steps = [n for name, n in calls if name == "index_match"]
        assert sum(steps) >= 4 * 4_096 and max(steps) <= MATCH_STEP
    finally:
        await store.close()
