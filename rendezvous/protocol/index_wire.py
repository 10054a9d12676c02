"""The one mapping between KvIndexService's messages (rendezvous.v1.index_pb2) and rendezvous.protocol.cache_index.

Both ways, as rendezvous.protocol.convert does for RendezvousService: the SDK builds requests and reads answers,
the service reads requests and builds answers. Shapes are kept as sent; the rules (sizes, hashes, sequences)
are rendezvous.core.cache_index's.
"""

from __future__ import annotations

from collections.abc import Sequence

from rendezvous.protocol.cache_index import (
    AllBlocksCleared,
    BlockHashing,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheReport,
    CacheSnapshot,
    IndexPosition,
    PrefixMatch,
    PrefixQuery,
)
from rendezvous.protocol.enums import EngineRole
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.v1 import index_pb2 as ipb


def hashing(m: ipb.BlockHashing) -> BlockHashing:
    """A BlockHashing message as the record."""
    return BlockHashing(m.algorithm, m.seed, m.block_size, m.integer_hashes)


def hashing_message(h: BlockHashing) -> ipb.BlockHashing:
    """The record as its message."""
    return ipb.BlockHashing(
        algorithm=h.algorithm, seed=h.seed, block_size=h.block_size, integer_hashes=h.integer_hashes
    )


def event(m: ipb.CacheEvent) -> CacheEvent | None:
    """A CacheEvent message as its record; None when none of its kinds is set (a newer client's)."""
    kind = m.WhichOneof("event")
    if kind == "stored":
        s = m.stored
        return BlocksStored(tuple(s.block_hashes), s.parent_block_hash, s.group_index, s.token_count)
    if kind == "removed":
        return BlocksRemoved(tuple(m.removed.block_hashes), m.removed.group_index)
    if kind == "cleared":
        return AllBlocksCleared()
    return None


def event_message(e: CacheEvent) -> ipb.CacheEvent:
    """The record as its message."""
    match e:
        case BlocksStored():
            stored = ipb.BlocksStored(
                block_hashes=e.block_hashes, parent_block_hash=e.parent, group_index=e.group, token_count=e.token_count
            )
            return ipb.CacheEvent(stored=stored)
        case BlocksRemoved():
            return ipb.CacheEvent(removed=ipb.BlocksRemoved(block_hashes=e.block_hashes, group_index=e.group))
        case AllBlocksCleared():
            return ipb.CacheEvent(cleared=ipb.AllBlocksCleared())


def report_request(r: CacheReport) -> ipb.ReportCacheEventsRequest:
    """A report as its request."""
    return ipb.ReportCacheEventsRequest(
        engine_id=r.engine_id,
        incarnation=r.incarnation,
        sequence=r.sequence,
        hashing=hashing_message(r.hashing) if r.hashing is not None else None,
        events=[event_message(e) for e in r.events],
    )


def report(m: ipb.ReportCacheEventsRequest) -> CacheReport:
    """The request as its report; an event of no kind this server knows is MESSAGE_INVALID."""
    events = [event(e) for e in m.events]
    if any(e is None for e in events):
        raise RendezvousError(Reason.MESSAGE_INVALID, "a CacheEvent sets none of stored, removed or cleared")
    return CacheReport(
        m.engine_id,
        m.sequence,
        tuple(e for e in events if e is not None),
        hashing(m.hashing) if m.HasField("hashing") else None,
        m.incarnation,
    )


def snapshot_request(s: CacheSnapshot) -> ipb.ReplaceCachedBlocksRequest:
    """A snapshot as its request."""
    return ipb.ReplaceCachedBlocksRequest(
        engine_id=s.engine_id,
        incarnation=s.incarnation,
        sequence=s.sequence,
        hashing=hashing_message(s.hashing),
        groups=[ipb.CachedBlocks(group_index=g, block_hashes=hashes) for g, hashes in s.groups],
    )


def snapshot(m: ipb.ReplaceCachedBlocksRequest) -> CacheSnapshot:
    """The request as its snapshot (hashing unset reads as an empty algorithm, which the rules refuse)."""
    return CacheSnapshot(
        m.engine_id,
        m.sequence,
        hashing(m.hashing),
        tuple((g.group_index, tuple(g.block_hashes)) for g in m.groups),
        m.incarnation,
    )


def query_request(q: PrefixQuery) -> ipb.MatchPrefixesRequest:
    """A query as its request."""
    return ipb.MatchPrefixesRequest(
        block_hashes=q.block_hashes,
        group_index=q.group,
        pools=q.pools,
        engine_ids=q.engine_ids,
        role=int(q.role or EngineRole.UNSPECIFIED),  # type: ignore[arg-type]
        min_matched_blocks=q.min_matched,
    )


def query(m: ipb.MatchPrefixesRequest) -> PrefixQuery:
    """The request as its query."""
    role = EngineRole(m.role)
    return PrefixQuery(
        tuple(m.block_hashes),
        m.group_index,
        tuple(m.pools),
        tuple(m.engine_ids),
        role if role is not EngineRole.UNSPECIFIED else None,
        m.min_matched_blocks,
    )


def match_message(p: PrefixMatch) -> ipb.PrefixMatch:
    """An engine's answer as its message."""
    return ipb.PrefixMatch(
        engine_id=p.engine_id,
        pool=p.pool,
        role=int(p.role),  # type: ignore[arg-type]
        matched_blocks=p.matched_blocks,
        hashing=hashing_message(p.hashing),
        sequence=p.sequence,
        incarnation=p.incarnation,
        at_least=p.at_least,
    )


def matches(ms: Sequence[ipb.PrefixMatch]) -> list[PrefixMatch]:
    """The answers of a MatchPrefixesResponse."""
    return [
        PrefixMatch(
            m.engine_id,
            m.pool,
            EngineRole(m.role),
            m.matched_blocks,
            hashing(m.hashing),
            m.sequence,
            m.incarnation,
            m.at_least,
        )
        for m in ms
    ]


def position(m: ipb.ReportCacheEventsResponse | ipb.ReplaceCachedBlocksResponse) -> IndexPosition:
    """Where the engine's entry stands, from either answer."""
    if isinstance(m, ipb.ReplaceCachedBlocksResponse):
        return IndexPosition(m.sequence, m.block_count, left_out=m.left_out, cut_by=m.cut_by)
    return IndexPosition(m.sequence, m.block_count, m.duplicate)
