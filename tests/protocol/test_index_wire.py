"""The KV index's one wire mapping (rendezvous.protocol.index_wire): what the SDK sends is what the service reads."""

from __future__ import annotations

import pytest

from rendezvous.protocol import index_wire
from rendezvous.protocol.cache_index import (
    AllBlocksCleared,
    BlockHashing,
    BlocksRemoved,
    BlocksStored,
    CacheReport,
    CacheSnapshot,
    PrefixMatch,
    PrefixQuery,
    hash_of,
)
from rendezvous.protocol.enums import EngineRole
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.v1 import index_pb2 as ipb

HASHING = BlockHashing("xxhash", "42", 32, integer_hashes=True)


def test_a_report_reads_back_as_sent() -> None:
    events = (BlocksStored((b"a", b"b"), b"p", 2, 40), BlocksRemoved((b"c",), 1), AllBlocksCleared())
    for hashing in (HASHING, None):
        report = CacheReport("e0", 9, events, hashing, incarnation=5)
        assert index_wire.report(index_wire.report_request(report)) == report


def test_a_snapshot_and_a_query_read_back_as_sent() -> None:
    snapshot = CacheSnapshot("e0", 3, HASHING, ((0, (b"a",)), (1, (b"b", b"c"))), incarnation=2)
    assert index_wire.snapshot(index_wire.snapshot_request(snapshot)) == snapshot
    for role in (None, EngineRole.CONSUMER):
        query = PrefixQuery((b"a", b"b"), 1, ("decode",), ("d0", "d1"), role, min_matched=2)
        assert index_wire.query(index_wire.query_request(query)) == query


def test_matches_read_back_as_sent() -> None:
    for at_least in (False, True):
        match = PrefixMatch("d0", "decode", EngineRole.CONSUMER, 7, HASHING, 11, 5, at_least)
        assert index_wire.matches([index_wire.match_message(match)]) == [match]


def test_an_event_of_no_kind_is_refused() -> None:
    with pytest.raises(RendezvousError) as caught:
        index_wire.report(ipb.ReportCacheEventsRequest(engine_id="e0", events=[ipb.CacheEvent()]))
    assert caught.value.reason == Reason.MESSAGE_INVALID


def test_integer_hashes_are_their_eight_bytes_big_endian() -> None:
    assert hash_of(1) == b"\x00" * 7 + b"\x01"
    assert hash_of((1 << 64) - 1) == b"\xff" * 8
    assert hash_of(b"\x01\x02") == b"\x01\x02"
