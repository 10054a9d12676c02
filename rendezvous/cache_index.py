"""The coordinator's KV index side: engines' cache reports and snapshots in, routers' prefix queries out.

`CacheIndex` checks the engine reported for (registered, live, the incarnation named), reads its entry from the
store's index (Store.index), asks rendezvous.core.cache_index to decide, and writes the decision with a
compare-and-set on the entry, reading again if another call moved it first. The coordinator owns one and drops an
engine's entry when its incarnation ends (Coordinator.lose_engine: deregistration, lease expiry,
re-registration; applied again when the tombstone ages). A call whose write may have landed after that drop (the
engine checked before the end, written after) checks the engine again once it has written, and drops what it
wrote if the incarnation ended meanwhile; a retry after the entry moved checks it again first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rendezvous.core import cache_index as rules
from rendezvous.core import engines as engine_rules
from rendezvous.core.limits import Limits
from rendezvous.core.model import Engine
from rendezvous.core.validation import check_id
from rendezvous.protocol.cache_index import CacheReport, CacheSnapshot, IndexPosition, PrefixMatch, PrefixQuery
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.store.base import Store
from rendezvous.store.cache_index import IndexBounds

_ATTEMPTS = 16
"""Compare-and-set rounds of one report before it gives up (only the engine's own calls contend)."""


class CacheIndex:
    """The KV index over a store's index."""

    def __init__(self, store: Store, limits: Limits, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.limits = limits
        self.clock = clock
        self._bounds = IndexBounds(limits.max_index_blocks_total, limits.max_index_blocks_per_identity)

    async def _engine(self, engine_id: str, incarnation: int) -> Engine:
        check_id("engine_id", engine_id, self.limits)
        engine = await self.store.get_engine(engine_id)
        return engine_rules.check_incarnation(self.clock(), engine, engine_id, incarnation)

    async def _still(self, engine: Engine) -> None:
        """After a write: if the incarnation it was checked against has ended since (deregistered, lapsed,
        re-registered), its end may have dropped the entry before the write landed, so drop what the write left and
        refuse the call as a later one would be. An end that comes after this check drops the entry itself."""
        try:
            await self._engine(engine.engine_id, engine.incarnation)
        except RendezvousError:
            await self.drop(engine)
            raise

    async def report(self, report: CacheReport) -> IndexPosition:
        """Apply one numbered batch of an engine's cache events (all or nothing)."""
        rules.check_report(report, self.limits)
        engine = await self._engine(report.engine_id, report.incarnation)
        index = self.store.index()
        members = rules.members_read(report)
        for attempt in range(_ATTEMPTS):
            if attempt:  # the entry moved: the incarnation may have ended (its entry dropped) meanwhile
                engine = await self._engine(engine.engine_id, engine.incarnation)
            read = await index.read(engine.engine_id, members)
            write = rules.decide_report(read.entry, engine, report, read.held, self.limits)
            if write is None:
                assert read.entry is not None
                return IndexPosition(read.entry.sequence, read.entry.block_count, duplicate=True)
            if await index.write(read, write, self._bounds) is not None:
                await self._still(engine)
                return IndexPosition(write.entry.sequence, write.entry.block_count)
        raise _contended(engine.engine_id)

    async def replace(self, snapshot: CacheSnapshot) -> IndexPosition:
        """Replace an engine's entry by a snapshot of its cache, cut (never refused) where a bound on the index has no
        room for all of it: its leading blocks, the answer's left_out saying how many were not indexed and cut_by
        which bound cut it (the tightest: the engine's, or the server's or its identity's, which the store applies)."""
        rules.check_snapshot(snapshot, self.limits)
        engine = await self._engine(snapshot.engine_id, snapshot.incarnation)
        index = self.store.index()
        for attempt in range(_ATTEMPTS):
            if attempt:
                engine = await self._engine(engine.engine_id, engine.incarnation)
            read = await index.read(engine.engine_id, ())
            write = rules.decide_snapshot(read.entry, engine, snapshot, self.limits)
            written = await index.write(read, write, self._bounds)
            if written is not None:  # cut, where a bound had no room for all of it (IndexWrite.cut)
                await self._still(engine)
                kept = written.entry
                left_out = write.left_out + write.entry.block_count - kept.block_count
                cut_by = written.cut_by or ("engine" if write.left_out else "")
                return IndexPosition(kept.sequence, kept.block_count, left_out=left_out, cut_by=cut_by)
        raise _contended(engine.engine_id)

    async def match(self, query: PrefixQuery) -> list[PrefixMatch]:
        """How many leading blocks of the query's chain each selected indexed engine holds (within
        max_index_query_lookups lookups: rendezvous.store.cache_index.leading_counts). An engine not alive by the
        clock now (its lease expired, not swept yet) is left out, as ListEngines leaves it out."""
        rules.check_query(query, self.limits)
        return await self.store.index().match(query, self.limits.max_index_query_lookups, self.clock())

    async def drop(self, ended: Engine) -> None:
        """Forget what an ended incarnation (or an older one) reported."""
        await self.store.index().drop(ended.engine_id, ended.incarnation)


def _contended(engine_id: str) -> RendezvousError:
    return RendezvousError(
        Reason.STORE_UNAVAILABLE,
        f"engine {engine_id}: its KV index entry kept changing under this call; retry",
        engine_id=engine_id,
    )
