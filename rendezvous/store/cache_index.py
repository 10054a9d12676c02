"""Where the KV index lives (rendezvous.core.cache_index decides what goes in).

Each engine with reports has an entry (its incarnation, pool, role, sequence, hashing and block count) and a set
of members (rendezvous.core.cache_index.member). A write is a compare-and-set on the entry's version as read
(`IndexRead.version`), which every write moves (a snapshot at the entry's own sequence too: it replaces the set
without moving the sequence), so two calls that decided on the same entry cannot both write: the second reads
again, and never writes a count decided on a set that changed since. The server's
bound on all blocks (max_index_blocks_total) and an identity's on its engines' blocks (max_index_blocks_per_identity)
are checked in the step that writes: a report that would pass one is refused (INDEX_FULL), a snapshot is cut to
what fits (`most_after`; the write says which bound cut it, `Written.cut_by`), so that a full index never keeps an
entry's old blocks, ones the engine may have evicted since, in place of its snapshot. `MemoryIndex` serves the memory
store; the Redis store has the same contract in Lua (rendezvous/store/redis/cache_index.py).

A query counts each selected engine's leading blocks level by level (`leading_counts`), in steps of at most
`MATCH_STEP` lookups between which the memory store gives the event loop back, and within a budget of lookups
(max_index_query_lookups): both stores give the same answer, cut at the same depth.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from rendezvous.core.cache_index import IndexEntry, IndexWrite, member
from rendezvous.core.limits import Limits
from rendezvous.pacing import Pacer
from rendezvous.protocol.cache_index import PrefixMatch, PrefixQuery
from rendezvous.protocol.errors import Reason, RendezvousError

MATCH_STEP = 4_096
"""The most block lookups of one step of a query: between two of them the memory store may give the event loop
back (rendezvous.pacing); the Redis store makes each step one script call."""

Probe = Callable[[Sequence[int], int, int], Awaitable[Sequence[int]]]
"""probe(engines, start, stop): for each of engines (indexes into the query's selected engines), how many of the
chain's blocks start, start + 1, ... before stop it holds in a row from start."""


@dataclass(frozen=True)
class IndexRead:
    """An engine's entry (None: none) and whether it holds each member asked for, as of one instant."""

    entry: IndexEntry | None
    held: dict[bytes, bool]
    version: str = ""
    """The entry's version, opaque ("" for none): what a write decided on this read expects. Every write moves it."""


@dataclass(frozen=True)
class IndexBounds:
    """The bounds a write must keep to in the step that writes: all blocks (max_index_blocks_total) and an
    identity's engines' blocks (max_index_blocks_per_identity; entries without an owner are not bounded by it)."""

    total: int
    per_identity: int


def index_full(scope: str, limit: int, have: int, adding: int) -> RendezvousError:
    """The refusal of a write past the server's bound (scope "server") or its identity's ("identity")."""
    whose = "the server's" if scope == "server" else "its identity's"
    return RendezvousError(
        Reason.INDEX_FULL,
        f"the KV index holds {have} blocks there; {adding} more would pass {whose} limit of {limit}",
        scope=scope,
        limit=limit,
        have=have,
        adding=adding,
    )


def most_after(
    before: int, total: int, owned: int, charged_here: bool, owner: str, bounds: IndexBounds
) -> tuple[int, str]:
    """The most blocks an entry holding `before` may hold after a write, within bounds, and the bound that sets it
    ("server" or "identity": the lower; the server's on a tie): what fits under the server's bound (all entries hold
    `total`) and, with an owner, under its identity's (its entries hold `owned`, this one's among them when
    charged_here), and never fewer than it held (shrinking is always allowed). A cut snapshot keeps this many
    (`IndexWrite.cut`); index_write.lua computes the same."""
    most, bound = max(before, bounds.total - total + before), "server"
    if owner:
        mine = before if charged_here else 0
        mine_most = max(mine, bounds.per_identity - owned + mine)
        if mine_most < most:
            most, bound = mine_most, "identity"
    return most, bound


@dataclass(frozen=True)
class Written:
    """What a write wrote: the entry (a cut write's saying how many blocks it kept), and the bound that cut it."""

    entry: IndexEntry
    cut_by: str = ""
    """"server" or "identity" where the server's or the identity's bound had no room for all of a cut write's adds
    (`most_after`); "" when it was written whole."""


def ranked(matches: Sequence[PrefixMatch]) -> list[PrefixMatch]:
    """Most matched blocks first, then by engine id (MatchPrefixesResponse's order)."""
    return sorted(matches, key=lambda m: (-m.matched_blocks, m.engine_id))


async def leading_counts(engines: int, length: int, budget: int, probe: Probe) -> tuple[list[int], int]:
    """How many leading blocks of a chain of length each of engines holds, counted level by level within budget
    lookups, and the depth D the levels stopped at. Level i looks up block i of each engine that holds blocks 0 to
    i - 1, one lookup each; the levels go on while the next one fits in what is left of the budget. D (the chain's
    length, unless the budget ran out) is the same whatever the steps: the largest D with
    sum(min(count + 1, D)) <= budget over the exact counts. An engine's answer is min(its count, D): exact below D,
    at least D where it says D (`answers`).

    The levels go in windows (each level of one affordable), each window in steps of at most MATCH_STEP lookups:
    probe calls, which the memory store makes without waiting and the Redis store as one script each."""
    counts = [0] * engines
    alive = list(range(engines))
    depth = spent = 0
    pacer = Pacer()
    while alive and depth < length and budget - spent >= len(alive):
        width = min(length - depth, (budget - spent) // len(alive), max(1, MATCH_STEP // len(alive)))
        per_step = max(1, MATCH_STEP // width)
        survivors = []
        for first in range(0, len(alive), per_step):
            part = alive[first : first + per_step]
            held = await probe(part, depth, depth + width)
            for i, n in zip(part, held, strict=True):
                counts[i] = depth + n
                spent += min(n + 1, width)
                if n == width:
                    survivors.append(i)
            await pacer.tick()
        alive = survivors
        depth += width
    return counts, depth


def answers(entries: Sequence[IndexEntry], counts: Sequence[int], depth: int, query: PrefixQuery) -> list[PrefixMatch]:
    """The query's answer (`ranked`) from its selected entries' leading counts, cut at depth: an engine counted to a
    depth short of the chain's length holds at least that many. Entries holding fewer than query.min_matched are
    left out."""
    cut = depth < len(query.block_hashes)
    return ranked(
        [
            PrefixMatch(e.engine_id, e.pool, e.role, n, e.hashing, e.sequence, e.incarnation, cut and n == depth)
            for e, n in zip(entries, counts, strict=True)
            if n >= query.min_matched
        ]
    )


def named(query: PrefixQuery, entries: dict[str, IndexEntry]) -> list[IndexEntry]:
    """The entries of the query's engine_ids, each once, looked up one by one (work in proportion to the ids, not
    to every entry times every id); all entries when it names none."""
    if not query.engine_ids:
        return list(entries.values())
    found = (entries.get(engine_id) for engine_id in dict.fromkeys(query.engine_ids))
    return [e for e in found if e is not None]


def narrows(query: PrefixQuery) -> Callable[[IndexEntry], bool]:
    """Whether an entry is of one of the query's pools (none: any) and of its role (None: any); a set lookup."""
    pools, role = frozenset(query.pools), query.role
    return lambda e: (not pools or e.pool in pools) and (role is None or e.role == role)


class IndexStore(ABC):
    """Engines' entries and block sets, with the server's bound on all blocks."""

    @abstractmethod
    async def read(self, engine_id: str, members: Sequence[bytes]) -> IndexRead:
        """An engine's entry and whether it holds each of members."""

    @abstractmethod
    async def write(self, expected: IndexRead | None, write: IndexWrite, bounds: IndexBounds) -> Written | None:
        """Apply write if the engine's entry is still the one expected read (its version; None: no entry), moving
        the version; what it wrote. None (nothing written) when any write came between; INDEX_FULL when a
        growth would pass one of bounds (the server's first, then the new entry's owner's: its blocks so far, less
        the entry's own if it was charged to it), except that a cut write (a snapshot) keeps the leading
        `most_after` of its adds instead, the entry written saying how many and `cut_by` which bound cut it."""

    @abstractmethod
    async def match(
        self, query: PrefixQuery, max_lookups: int = Limits.max_index_query_lookups, now: float | None = None
    ) -> list[PrefixMatch]:
        """For each entry the query selects, how many leading blocks of its chain it holds (`ranked`), counted by
        `leading_counts` within max_lookups; entries holding fewer than query.min_matched are left out, and, with
        now, those whose engine is not alive at now (Engine.alive: ended, or its lease expired and not swept yet),
        as ListEngines leaves them out. Not one instant: a block counts as it was when it was looked up."""

    @abstractmethod
    async def drop(self, engine_id: str, incarnation: int) -> bool:
        """Drop the engine's entry and blocks if they belong to incarnation or an older one; whether it did."""

    @abstractmethod
    async def total(self) -> int:
        """The blocks held over the server (what max_index_blocks_total bounds)."""


class MemoryIndex(IndexStore):
    """Dicts; atomic because nothing awaits between a check and its write on the one event loop."""

    def __init__(self, alive: Callable[[str, float], bool] | None = None) -> None:
        """alive(engine_id, now): whether the engine is registered and alive at now (the store's engine records);
        None: every entry's engine is."""
        self._alive = alive or (lambda engine_id, now: True)
        self._entries: dict[str, IndexEntry] = {}
        self._blocks: dict[str, set[bytes]] = {}
        self._total = 0
        self._owned: Counter[str] = Counter()
        self._versions: dict[str, str] = {}
        self._writes = 0

    async def read(self, engine_id: str, members: Sequence[bytes]) -> IndexRead:
        held = self._blocks.get(engine_id, set())
        return IndexRead(
            self._entries.get(engine_id), {m: m in held for m in members}, self._versions.get(engine_id, "")
        )

    async def write(self, expected: IndexRead | None, write: IndexWrite, bounds: IndexBounds) -> Written | None:
        new, adds, cut_by = write.entry, write.adds, ""
        engine_id, owner = new.engine_id, new.owner
        current = self._entries.get(engine_id)
        if self._versions.get(engine_id, "") != (expected.version if expected is not None else ""):
            return None
        blocks = self._blocks.get(engine_id, set())
        before = len(blocks)
        after = new.block_count
        charged = current.owner if current is not None else ""
        if write.cut:
            most, bound = most_after(before, self._total, self._owned[owner], charged == owner, owner, bounds)
            if after > most:
                adds, after, cut_by = list(adds)[:most], most, bound
                new = replace(new, block_count=most)
        if after > before and self._total + after - before > bounds.total:
            raise index_full("server", bounds.total, self._total, after - before)
        mine = after - (before if charged == owner else 0)
        if owner and mine > 0 and self._owned[owner] + mine > bounds.per_identity:
            raise index_full("identity", bounds.per_identity, self._owned[owner], mine)
        if write.reset:
            blocks = set()
        blocks.update(adds)
        blocks.difference_update(write.removes)
        assert len(blocks) == after, "the decision's count is the set's"
        self._blocks[engine_id] = blocks
        self._entries[engine_id] = new
        self._writes += 1
        self._versions[engine_id] = str(self._writes)
        self._total += after - before
        self._owned[charged] -= before
        self._owned[owner] += after
        return Written(new, cut_by)

    async def match(
        self, query: PrefixQuery, max_lookups: int = Limits.max_index_query_lookups, now: float | None = None
    ) -> list[PrefixMatch]:
        # The entries and their sets as of now (a report changes a set in place, a snapshot or drop swaps it).
        every = [(e, self._blocks[e.engine_id]) for e in named(query, self._entries)]
        selected = narrows(query)
        pacer = Pacer()
        chosen = []
        for pair in every:
            if selected(pair[0]) and (now is None or self._alive(pair[0].engine_id, now)):
                chosen.append(pair)
            await pacer.tick()
        chain = [member(query.group, h) for h in query.block_hashes]  # once per query, not per engine

        async def probe(engines: Sequence[int], start: int, stop: int) -> list[int]:
            window = chain[start:stop]
            held = []
            for i in engines:
                blocks, n = chosen[i][1], 0
                for m in window:
                    if m not in blocks:
                        break
                    n += 1
                held.append(n)
            return held

        counts, depth = await leading_counts(len(chosen), len(chain), max_lookups, probe)
        return answers([e for e, _ in chosen], counts, depth, query)

    async def drop(self, engine_id: str, incarnation: int) -> bool:
        entry = self._entries.get(engine_id)
        if entry is None or entry.incarnation > incarnation:
            return False
        del self._entries[engine_id]
        del self._versions[engine_id]
        held = len(self._blocks.pop(engine_id))
        self._total -= held
        self._owned[entry.owner] -= held
        return True

    async def total(self) -> int:
        return self._total
