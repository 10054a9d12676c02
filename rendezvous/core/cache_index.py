"""The KV index's rules: what a report or snapshot of an engine's cache may be, and what it writes.

Pure: the store reads an engine's entry and whether it holds the blocks a report names (`members_read`), these
functions decide, and the store writes the decision only if the entry is still the one read (its incarnation and
sequence are its version). A block is a member: its KV cache group (4 bytes) and its hash, so the groups of a
hybrid model never mix.

Sequences: an entry's first batch (or the first of a newer incarnation) starts the count at its own sequence; then
each batch must carry the next one. The same sequence again is a duplicate (a no-op: a retried call; the events
are not compared, since a sequence names one batch: docs/protocol.md, "The KV index"), an older one
is refused (INDEX_SEQUENCE_STALE), a later one is a gap (INDEX_SEQUENCE_GAP, repaired by a snapshot). A stored
block's parent must be held when it is stored, else the batch is refused (INDEX_PARENT_UNKNOWN): the index never
holds a chain that does not link, and never claims a block the engine reported removed, since events apply in
order and a batch applies whole or not at all.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from rendezvous.core.limits import Limits
from rendezvous.core.model import Engine, Role
from rendezvous.core.validation import check_batch, check_id
from rendezvous.protocol.cache_index import (
    MAX_HASH_BYTES,
    AllBlocksCleared,
    BlockHashing,
    BlocksRemoved,
    BlocksStored,
    CacheReport,
    CacheSnapshot,
    PrefixQuery,
)
from rendezvous.protocol.errors import Reason, RendezvousError

MAX_ALGORITHM_BYTES = 64
MAX_SEED_BYTES = 256


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """An engine's entry as stored, less its blocks: whose it is and where its sequence stands."""

    engine_id: str
    incarnation: int
    pool: str
    role: Role
    sequence: int
    hashing: BlockHashing
    block_count: int
    owner: str = ""
    """The identity the engine's incarnation was registered by (Engine.owner): its blocks count against that
    identity's bound (max_index_blocks_per_identity)."""


@dataclass(frozen=True, slots=True)
class IndexWrite:
    """What a report or snapshot writes: the new entry, and the members to add and remove (reset: every member
    the entry held goes first)."""

    entry: IndexEntry
    reset: bool
    adds: Collection[bytes]
    removes: Collection[bytes]
    left_out: int = 0
    """A snapshot's distinct blocks past max_index_blocks_per_engine, not written (`decide_snapshot`)."""
    cut: bool = False
    """A snapshot's write (reset, adds distinct and in the order to keep): where the server's or its identity's
    bound has no room for all of adds, the store keeps the longest leading part that fits, never fewer blocks than
    the entry held, instead of refusing (rendezvous.store.cache_index.IndexStore.write)."""


def member(group: int, block_hash: bytes) -> bytes:
    """A block as the index keys it: its group and its hash."""
    return group.to_bytes(4, "big") + block_hash


# Shapes, checked before anything is read


def _check_hashes(hashes: Iterable[bytes]) -> int:
    n = 0
    for h in hashes:
        if not 0 < len(h) <= MAX_HASH_BYTES:
            raise RendezvousError(
                Reason.BLOCK_HASH_INVALID, f"a block hash has {len(h)} bytes; 1 to {MAX_HASH_BYTES} are allowed"
            )
        n += 1
    return n


INTEGER_HASH_BYTES = 8
"""The size of a block hash of an engine that announces integer_hashes: a 64-bit integer, big-endian."""


def _check_integer_hashes(hashing: BlockHashing, hashes: Iterable[bytes]) -> None:
    """With integer_hashes announced, every hash (and parent) must be the 8 bytes of a 64-bit integer."""
    if not hashing.integer_hashes:
        return
    for h in hashes:
        if len(h) != INTEGER_HASH_BYTES:
            raise RendezvousError(
                Reason.BLOCK_HASH_INVALID,
                f"a block hash has {len(h)} bytes; an engine with integer_hashes sends {INTEGER_HASH_BYTES}",
            )


def _report_hashes(report: CacheReport) -> Iterable[bytes]:
    for e in report.events:
        if isinstance(e, BlocksStored):
            if e.parent:
                yield e.parent
            yield from e.block_hashes
        elif isinstance(e, BlocksRemoved):
            yield from e.block_hashes


def _check_total(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise RendezvousError(
            Reason.INDEX_QUERY_TOO_LARGE, f"{n} {what} in one request; the limit is {limit}", limit=limit
        )


def check_hashing(hashing: BlockHashing | None) -> BlockHashing:
    """The announced hashing, or INDEX_HASHING_MISSING when there is none or it is malformed."""
    if hashing is None or not hashing.algorithm:
        raise RendezvousError(
            Reason.INDEX_HASHING_MISSING, "the entry's first report or a snapshot must say how blocks are hashed"
        )
    if (
        len(hashing.algorithm.encode()) > MAX_ALGORITHM_BYTES
        or len(hashing.seed.encode()) > MAX_SEED_BYTES
        or hashing.block_size < 1
    ):
        raise RendezvousError(
            Reason.INDEX_HASHING_MISSING,
            f"hashing needs an algorithm of at most {MAX_ALGORITHM_BYTES} bytes, a seed of at most {MAX_SEED_BYTES}"
            " and a block_size of at least 1",
        )
    return hashing


def check_report(report: CacheReport, limits: Limits) -> None:
    """A report's shape: events, hashes (sizes and count) and token counts."""
    check_batch(len(report.events), limits)
    total = 0
    for e in report.events:
        if isinstance(e, AllBlocksCleared):
            continue
        n = _check_hashes(e.block_hashes)
        if not n:
            raise RendezvousError(Reason.BLOCK_HASH_INVALID, "a stored or removed event names no block")
        if isinstance(e, BlocksStored):
            if e.parent:
                _check_hashes((e.parent,))
            if report.hashing is not None and e.token_count > n * report.hashing.block_size:
                raise RendezvousError(
                    Reason.BLOCK_HASH_INVALID, f"{e.token_count} tokens do not fit in {n} blocks of the engine's size"
                )
        total += n
    _check_total(total, limits.max_index_blocks_per_request, "block hashes")


def check_snapshot(snapshot: CacheSnapshot, limits: Limits) -> None:
    """A snapshot's shape: its hashing and hashes."""
    check_hashing(snapshot.hashing)
    total = sum(_check_hashes(hashes) for _, hashes in snapshot.groups)
    _check_integer_hashes(snapshot.hashing, (h for _, hashes in snapshot.groups for h in hashes))
    _check_total(total, limits.max_index_blocks_per_request, "block hashes")


def check_query(query: PrefixQuery, limits: Limits) -> None:
    """A query's shape: a chain of at most max_index_query_blocks, at most max_index_query_engines pools and
    engines, each id well-formed (rendezvous.core.validation.check_id). The counts are checked before any hash or
    id is looked at."""
    _check_total(len(query.block_hashes), limits.max_index_query_blocks, "chain blocks")
    _check_total(len(query.pools), limits.max_index_query_engines, "pools")
    _check_total(len(query.engine_ids), limits.max_index_query_engines, "engine ids")
    for pool in query.pools:
        check_id("pool", pool, limits)
    for engine_id in query.engine_ids:
        check_id("engine_id", engine_id, limits)
    if not _check_hashes(query.block_hashes):
        raise RendezvousError(Reason.BLOCK_HASH_INVALID, "the query's chain names no block")


# Decisions


def members_read(report: CacheReport) -> list[bytes]:
    """The members whose presence the decision on report needs: every block it stores, removes or links to."""
    wanted: dict[bytes, None] = {}
    for e in report.events:
        if isinstance(e, BlocksStored):
            if e.parent:
                wanted[member(e.group, e.parent)] = None
            wanted.update((member(e.group, h), None) for h in e.block_hashes)
        elif isinstance(e, BlocksRemoved):
            wanted.update((member(e.group, h), None) for h in e.block_hashes)
    return list(wanted)


def _fresh(entry: IndexEntry | None, engine: Engine) -> bool:
    """Whether the engine's current incarnation has no entry yet (none, or an older incarnation's). An entry of a
    newer incarnation than the one the call was checked against (it re-registered since) is STALE_INCARNATION: the
    call would write over the successor's entry under the older incarnation."""
    if entry is not None and entry.incarnation > engine.incarnation:
        raise RendezvousError(
            Reason.STALE_INCARNATION,
            f"engine {engine.engine_id} incarnation {engine.incarnation} was replaced by {entry.incarnation}",
            engine_id=engine.engine_id,
            current_incarnation=entry.incarnation,
        )
    return entry is None or entry.incarnation < engine.incarnation


def _check_sequence(entry: IndexEntry, sequence: int, snapshot: bool) -> bool:
    """True for a duplicate (reports only); raises for a stale or (reports only) a gapped sequence."""
    if sequence == entry.sequence and not snapshot:
        return True
    if sequence < entry.sequence:
        raise RendezvousError(
            Reason.INDEX_SEQUENCE_STALE,
            f"engine {entry.engine_id}: sequence {sequence} is older than the last applied, {entry.sequence}",
            engine_id=entry.engine_id,
            expected_sequence=entry.sequence + 1,
            sequence=sequence,
        )
    if sequence > entry.sequence + 1 and not snapshot:
        raise RendezvousError(
            Reason.INDEX_SEQUENCE_GAP,
            f"engine {entry.engine_id}: sequence {sequence} follows {entry.sequence}: events were lost; send a"
            " snapshot (ReplaceCachedBlocks)",
            engine_id=entry.engine_id,
            expected_sequence=entry.sequence + 1,
            sequence=sequence,
        )
    return False


def _check_room(engine_id: str, before: int, after: int, limits: Limits) -> None:
    if after > before and after > limits.max_index_blocks_per_engine:
        raise RendezvousError(
            Reason.INDEX_FULL,
            f"engine {engine_id} would hold {after} blocks in the index; the limit is"
            f" {limits.max_index_blocks_per_engine}",
            scope="engine",
            limit=limits.max_index_blocks_per_engine,
            have=before,
            adding=after - before,
        )


def decide_report(
    entry: IndexEntry | None, engine: Engine, report: CacheReport, held: Mapping[bytes, bool], limits: Limits
) -> IndexWrite | None:
    """What report writes over entry (None: a duplicate, nothing to write). held: whether the entry holds each
    of `members_read(report)`, read with it. engine: the live incarnation reported for."""
    fresh = _fresh(entry, engine)
    if fresh or entry is None:
        hashing, before = check_hashing(report.hashing), 0
    else:
        if _check_sequence(entry, report.sequence, snapshot=False):
            return None
        if report.hashing is not None and report.hashing != entry.hashing:
            raise RendezvousError(
                Reason.INDEX_HASHING_MISMATCH,
                f"engine {engine.engine_id} announced other hashing before; a snapshot may change it",
                engine_id=engine.engine_id,
            )
        hashing, before = entry.hashing, entry.block_count
    _check_integer_hashes(hashing, _report_hashes(report))
    cleared = fresh
    state: dict[bytes, bool] = {}

    def holds(m: bytes) -> bool:
        return state[m] if m in state else (not cleared and held.get(m, False))

    for e in report.events:
        match e:
            case BlocksStored():
                previous = e.parent
                for h in e.block_hashes:
                    if previous and not holds(member(e.group, previous)):
                        raise RendezvousError(
                            Reason.INDEX_PARENT_UNKNOWN,
                            f"engine {engine.engine_id}: a stored block's parent is not held; send a snapshot",
                            engine_id=engine.engine_id,
                            group_index=e.group,
                        )
                    state[member(e.group, h)] = True
                    previous = h
            case BlocksRemoved():
                for h in e.block_hashes:
                    state[member(e.group, h)] = False
            case AllBlocksCleared():
                state.clear()
                cleared = True
    adds = frozenset(m for m, v in state.items() if v and (cleared or not held.get(m, False)))
    removes = frozenset() if cleared else frozenset(m for m, v in state.items() if not v and held.get(m, False))
    after = len(adds) if cleared else before + len(adds) - len(removes)
    _check_room(engine.engine_id, before, after, limits)
    new = IndexEntry(
        engine.engine_id, engine.incarnation, engine.pool, engine.role, report.sequence, hashing, after, engine.owner
    )
    return IndexWrite(new, cleared, adds, removes)


def decide_snapshot(entry: IndexEntry | None, engine: Engine, snapshot: CacheSnapshot, limits: Limits) -> IndexWrite:
    """What snapshot writes over entry: everything replaced. A snapshot older than the entry's sequence (of the
    same incarnation) is INDEX_SEQUENCE_STALE: it would undo later reports.

    A snapshot of more distinct blocks than max_index_blocks_per_engine is cut, not refused: its first blocks in
    the order sent (groups in order, each group's hashes in order) are kept, the rest left out (`left_out`). A
    refusal would leave the entry's old blocks, ones the engine may no longer hold, in the index for good, since
    every later snapshot of that engine would be refused too. The sender orders by what it wants kept: the server
    sees no chain in a snapshot, so it cannot tell a root from a leaf. The server's and the identity's bounds cut it
    the same way, in the step that writes (`IndexWrite.cut`)."""
    hashing = check_hashing(snapshot.hashing)
    if not _fresh(entry, engine) and entry is not None:
        _check_sequence(entry, snapshot.sequence, snapshot=True)
    ordered = dict.fromkeys(member(group, h) for group, hashes in snapshot.groups for h in hashes)
    room = limits.max_index_blocks_per_engine
    left_out = max(0, len(ordered) - room)
    adds = tuple(ordered)[:room]
    new = IndexEntry(
        engine.engine_id,
        engine.incarnation,
        engine.pool,
        engine.role,
        snapshot.sequence,
        hashing,
        len(adds),
        engine.owner,
    )
    return IndexWrite(new, True, adds, frozenset(), left_out, cut=True)
