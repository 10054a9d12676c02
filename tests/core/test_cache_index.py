"""The KV index's rules (rendezvous.core.cache_index), without a store: sequences, parents, bounds, shapes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from rendezvous import core
from rendezvous.core import engines as engine_rules
from rendezvous.core.cache_index import (
    IndexEntry,
    IndexWrite,
    check_query,
    check_report,
    decide_report,
    decide_snapshot,
    member,
    members_read,
)
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Engine
from rendezvous.protocol.cache_index import (
    AllBlocksCleared,
    BlockHashing,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheReport,
    CacheSnapshot,
    PrefixQuery,
)
from rendezvous.protocol.errors import Reason, RendezvousError
from tests.factories import core_engine

HASHING = BlockHashing("sha256", "0", 16)
LIMITS = Limits()


def engine(engine_id: str = "p0", now: float = 100.0) -> Engine:
    spec = core_engine(engine_id, core.Role.PRODUCER)
    return engine_rules.register_engine(now, None, spec, LIMITS, Timeouts(), 1)


def report(sequence: int, *events: CacheEvent, hashing: BlockHashing | None = HASHING) -> CacheReport:
    return CacheReport("p0", sequence, events, hashing)


class Entry:
    """An engine's entry and blocks as a store would hold them: applies each decision it is given."""

    def __init__(self) -> None:
        self.entry: IndexEntry | None = None
        self.blocks: set[bytes] = set()

    def apply(self, write: IndexWrite | None) -> None:
        if write is None:
            return
        if write.reset:
            self.blocks = set()
        self.blocks = (self.blocks | set(write.adds)) - set(write.removes)
        assert len(self.blocks) == write.entry.block_count
        self.entry = write.entry

    def report(self, e: Engine, r: CacheReport, limits: Limits = LIMITS) -> IndexWrite | None:
        held = {m: m in self.blocks for m in members_read(r)}
        write = decide_report(self.entry, e, r, held, limits)
        self.apply(write)
        return write

    def holds(self, *hashes: bytes, group: int = 0) -> bool:
        return all(member(group, h) in self.blocks for h in hashes)


def stored(*hashes: bytes, parent: bytes = b"", group: int = 0) -> BlocksStored:
    return BlocksStored(tuple(hashes), parent, group)


def refused(reason: Reason, e: Entry, en: Engine, r: CacheReport) -> RendezvousError:
    with pytest.raises(RendezvousError) as caught:
        e.report(en, r)
    assert caught.value.reason == reason
    return caught.value


def test_a_chain_stored_in_order_is_held_and_the_sequence_advances() -> None:
    e, en = Entry(), engine()
    e.report(en, report(5, stored(b"a", b"b"), stored(b"c", parent=b"b")))
    assert e.holds(b"a", b"b", b"c") and e.entry is not None and e.entry.sequence == 5
    e.report(en, report(6, BlocksRemoved((b"c",))))
    assert not e.holds(b"c") and e.entry is not None and e.entry.block_count == 2


def test_the_same_sequence_again_is_a_no_op() -> None:
    e, en = Entry(), engine()
    e.report(en, report(1, stored(b"a")))
    assert e.report(en, report(1, BlocksRemoved((b"a",)))) is None
    assert e.holds(b"a")


def test_an_older_sequence_is_stale_and_a_later_one_a_gap() -> None:
    e, en = Entry(), engine()
    e.report(en, report(3, stored(b"a")))
    assert refused(Reason.INDEX_SEQUENCE_STALE, e, en, report(2, stored(b"x"))).metadata["expected_sequence"] == "4"
    assert refused(Reason.INDEX_SEQUENCE_GAP, e, en, report(5, stored(b"x"))).metadata["expected_sequence"] == "4"
    assert not e.holds(b"x")


def test_a_parent_not_held_refuses_the_whole_batch() -> None:
    e, en = Entry(), engine()
    e.report(en, report(1, stored(b"a")))
    refused(Reason.INDEX_PARENT_UNKNOWN, e, en, report(2, stored(b"b"), stored(b"d", parent=b"c")))
    assert not e.holds(b"b") and e.entry is not None and e.entry.sequence == 1


def test_a_parent_is_held_per_group() -> None:
    e, en = Entry(), engine()
    e.report(en, report(1, stored(b"a", group=0)))
    refused(Reason.INDEX_PARENT_UNKNOWN, e, en, report(2, stored(b"b", parent=b"a", group=1)))
    e.report(en, report(2, stored(b"b", parent=b"a", group=0), stored(b"a", group=1)))
    assert e.holds(b"a", group=1) and not e.holds(b"b", group=1)


def test_a_block_removed_then_used_as_parent_in_the_same_batch_is_refused() -> None:
    e, en = Entry(), engine()
    e.report(en, report(1, stored(b"a")))
    refused(Reason.INDEX_PARENT_UNKNOWN, e, en, report(2, BlocksRemoved((b"a",)), stored(b"b", parent=b"a")))


def test_cleared_forgets_everything_before_it_in_the_batch() -> None:
    e, en = Entry(), engine()
    e.report(en, report(1, stored(b"a", b"b")))
    e.report(en, report(2, stored(b"c", parent=b"b"), AllBlocksCleared(), stored(b"a")))
    assert e.holds(b"a") and not e.holds(b"b") and not e.holds(b"c")
    assert e.entry is not None and e.entry.block_count == 1


def test_the_first_report_needs_hashing_and_later_ones_must_keep_it() -> None:
    e, en = Entry(), engine()
    refused(Reason.INDEX_HASHING_MISSING, e, en, report(1, stored(b"a"), hashing=None))
    e.report(en, report(1, stored(b"a")))
    e.report(en, report(2, stored(b"b", parent=b"a"), hashing=None))
    refused(Reason.INDEX_HASHING_MISMATCH, e, en, report(3, stored(b"c"), hashing=replace(HASHING, seed="1")))


def test_a_newer_incarnation_starts_a_fresh_entry() -> None:
    e, en = Entry(), engine()
    e.report(en, report(9, stored(b"a")))
    newer = replace(en, incarnation=en.incarnation + 1)
    e.report(newer, report(0, stored(b"b")))
    assert not e.holds(b"a") and e.holds(b"b") and e.entry is not None and e.entry.sequence == 0


def test_an_older_incarnation_never_writes_over_a_newer_ones_entry() -> None:
    """A call checked against the engine before it re-registered reads the successor's entry: refused, so the
    entry keeps the successor's incarnation and blocks (the older one's write would relabel them as its own)."""
    e, older = Entry(), engine()
    newer = replace(older, incarnation=older.incarnation + 1)
    e.report(newer, report(0, stored(b"a")))
    err = refused(Reason.STALE_INCARNATION, e, older, report(1, stored(b"b", parent=b"a")))
    assert err.metadata["current_incarnation"] == str(newer.incarnation)
    with pytest.raises(RendezvousError) as caught:
        decide_snapshot(e.entry, older, CacheSnapshot("p0", 5, HASHING, ((0, (b"z",)),)), LIMITS)
    assert caught.value.reason == Reason.STALE_INCARNATION
    assert e.entry is not None and e.entry.incarnation == newer.incarnation and e.holds(b"a") and not e.holds(b"b")


def test_the_engine_bound_refuses_growth_but_not_shrinking() -> None:
    e, en = Entry(), engine()
    small = replace(LIMITS, max_index_blocks_per_engine=2)
    e.report(en, report(1, stored(b"a", b"b")), small)
    with pytest.raises(RendezvousError) as caught:
        e.report(en, report(2, stored(b"c", parent=b"b")), small)
    assert caught.value.reason == Reason.INDEX_FULL and caught.value.metadata["scope"] == "engine"
    e.report(en, report(2, BlocksRemoved((b"a",))), small)


def test_a_snapshot_replaces_the_entry_but_not_with_an_older_sequence() -> None:
    e, en = Entry(), engine()
    e.report(en, report(4, stored(b"a")))
    snapshot = CacheSnapshot("p0", 7, HASHING, ((0, (b"x", b"y")), (1, (b"x",))))
    e.apply(decide_snapshot(e.entry, en, snapshot, LIMITS))
    assert not e.holds(b"a") and e.holds(b"x", b"y") and e.holds(b"x", group=1)
    assert e.entry is not None and (e.entry.sequence, e.entry.block_count) == (7, 3)
    with pytest.raises(RendezvousError) as caught:
        decide_snapshot(e.entry, en, replace(snapshot, sequence=6), LIMITS)
    assert caught.value.reason == Reason.INDEX_SEQUENCE_STALE


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        ((), Reason.BATCH_EMPTY),
        ((stored(b""),), Reason.BLOCK_HASH_INVALID),
        ((stored(b"x" * 33),), Reason.BLOCK_HASH_INVALID),
        ((BlocksRemoved(()),), Reason.BLOCK_HASH_INVALID),
        ((BlocksStored((b"a",), b"", 0, 17),), Reason.BLOCK_HASH_INVALID),
    ],
)
def test_malformed_reports_are_refused_before_anything_is_read(events: Sequence[CacheEvent], reason: Reason) -> None:
    with pytest.raises(RendezvousError) as caught:
        check_report(report(1, *events), LIMITS)
    assert caught.value.reason == reason


def test_too_many_hashes_in_a_report_or_a_query_are_refused() -> None:
    limits = replace(LIMITS, max_index_blocks_per_request=3, max_index_query_blocks=2, max_index_query_engines=1)
    with pytest.raises(RendezvousError) as caught:
        check_report(report(1, stored(b"a", b"b"), BlocksRemoved((b"c", b"d"))), limits)
    assert caught.value.reason == Reason.INDEX_QUERY_TOO_LARGE
    for query in (PrefixQuery((b"a", b"b", b"c")), PrefixQuery((b"a",), pools=("x", "y"))):
        with pytest.raises(RendezvousError) as caught:
            check_query(query, limits)
        assert caught.value.reason == Reason.INDEX_QUERY_TOO_LARGE


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        (PrefixQuery((b"a",), engine_ids=("x" * 257,)), Reason.ID_TOO_LONG),
        (PrefixQuery((b"a",), pools=("a pool",)), Reason.ID_INVALID),
        (PrefixQuery(()), Reason.BLOCK_HASH_INVALID),
    ],
)
def test_a_query_names_well_formed_ids_and_at_least_one_block(query: PrefixQuery, reason: Reason) -> None:
    with pytest.raises(RendezvousError) as caught:
        check_query(query, LIMITS)
    assert caught.value.reason == reason
