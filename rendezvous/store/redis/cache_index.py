"""The KV index in Redis: the `IndexStore` contract (rendezvous/store/cache_index.py) in Lua scripts.

Keys (rendezvous/store/redis/scripts/__init__.py, docs/operations.md): `ix:<engine>` (the entry: version,
record, pool, role, incarnation, owner), `ixb:<engine>` (its block set), `ixe` (engines with an entry), `ixt`
(the blocks of all entries), `ixo` (the blocks of each owner's entries). A report reads the entry and the blocks
it names in one script (index_read), the core decides, and index_write applies the decision if the entry's
version (`v` "<incarnation>:<sequence>" and `w`, the write's number, new at every write) is unchanged and the
bounds hold. MatchPrefixes is one script when it is small (at most SELECT_STEP engines and MATCH_STEP lookups in
all: index_match_small, one round trip); else it goes in steps, so that no script holds Redis for long (every
replica shares it): the entries of the engines asked about, SELECT_STEP at a time (index_select), then the lookups
of rendezvous.store.cache_index.leading_counts, at most MATCH_STEP a call (index_match), cut as the memory store
cuts them. Writes carry the store's epoch guard, as every write does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

from rendezvous.core.cache_index import IndexEntry, IndexWrite, member
from rendezvous.core.limits import Limits
from rendezvous.core.model import Role
from rendezvous.protocol.cache_index import BlockHashing, PrefixMatch, PrefixQuery
from rendezvous.store.cache_index import (
    MATCH_STEP,
    IndexBounds,
    IndexRead,
    IndexStore,
    Written,
    answers,
    index_full,
    leading_counts,
)
from rendezvous.store.codec import future_format
from rendezvous.store.redis.guarded import GuardedScripts

"""Epoch refusals a write retries after acting on them."""


SELECT_STEP = 1_024
"""Engines whose entries one index_select call reads (a query naming its most engines takes one call)."""


def encode_parts(e: IndexEntry) -> tuple[str, str]:
    """An entry as JSON text, less its block count: the text is head, the count, tail (index_write.lua writes the
    count a cut snapshot kept)."""
    h = e.hashing

    def text(fields: list[object]) -> str:
        return json.dumps(fields, separators=(",", ":"))

    head = [e.engine_id, e.incarnation, e.pool, int(e.role), e.sequence, h.algorithm, h.seed, h.block_size,
            h.integer_hashes]  # fmt: skip
    return text(head)[:-1] + ",", "," + text([e.owner])[1:]


def decode(data: bytes | str) -> IndexEntry:
    """The entry of encode_parts's text (head, count, tail). Its format (1) is its shape: a later one starts with
    its number and is refused (FutureFormatError), never misread."""
    f = json.loads(data)
    if type(f[0]) is int:
        raise future_format("KV index entry", f[0])
    hashing = BlockHashing(str(f[5]), str(f[6]), int(f[7]), bool(f[8]))
    return IndexEntry(str(f[0]), int(f[1]), str(f[2]), Role(int(f[3])), int(f[4]), hashing, int(f[9]), str(f[10]))


def _version(entry: IndexEntry) -> str:
    """What 0.1.0's replicas compare alone (index_write.lua adds the write's number)."""
    return f"{entry.incarnation}:{entry.sequence}"


class RedisIndex(GuardedScripts, IndexStore):
    """The KV index of one Redis namespace, run through the store's scripts and epoch."""

    async def read(self, engine_id: str, members: Sequence[bytes]) -> IndexRead:
        reply = await self._scripts.run("index_read", engine_id=engine_id, members=list(members))
        entry = decode(reply[1]) if reply[1] else None
        held = {m: bool(h) for m, h in zip(members, reply[2:], strict=True)}
        return IndexRead(entry, held, reply[0].decode())

    async def write(self, expected: IndexRead | None, write: IndexWrite, bounds: IndexBounds) -> Written | None:
        e = write.entry
        head, tail = encode_parts(e)
        reply = await self._write(
            "index_write",
            engine_id=e.engine_id,
            expected=expected.version if expected is not None else "",
            version=_version(e),
            record_head=head,
            record_tail=tail,
            pool=e.pool,
            role=int(e.role),
            incarnation=e.incarnation,
            owner=e.owner,
            reset=1 if write.reset else 0,
            cut=1 if write.cut else 0,
            count=e.block_count,
            max_total=bounds.total,
            max_owner=bounds.per_identity,
            adds=list(write.adds),
            removes=list(write.removes),
        )
        if reply[0] == b"B":
            scope = reply[1].decode()
            raise index_full(scope, bounds.total if scope == "server" else bounds.per_identity, *map(int, reply[2:]))
        if reply[0] != b"OK":
            return None
        kept = int(reply[1])
        return Written(e if kept == e.block_count else replace(e, block_count=kept), reply[2].decode())

    async def match(
        self, query: PrefixQuery, max_lookups: int = Limits.max_index_query_lookups, now: float | None = None
    ) -> list[PrefixMatch]:
        live_at = "" if now is None else repr(now)
        ids = list(dict.fromkeys(query.engine_ids))
        chain = [member(query.group, h) for h in query.block_hashes]
        if len(ids) <= SELECT_STEP:  # most queries: one script (one round trip), if it needs at most MATCH_STEP lookups
            small = await self._scripts.run(
                "index_match_small",
                role=int(query.role or 0),
                most=SELECT_STEP,
                budget=min(MATCH_STEP, max_lookups),
                now=live_at,
                pools=list(query.pools),
                engine_ids=ids,
                members=chain,
            )
            if int(small[0]):
                selected = [decode(record) for record in small[1::2]]
                return answers(selected, [int(n) for n in small[2::2]], len(chain), query)
        if not ids:
            ids = sorted(m.decode() for m in await self._command("SMEMBERS", self._prefix + "ixe"))
        entries: list[IndexEntry] = []
        for first in range(0, len(ids), SELECT_STEP):
            reply = await self._scripts.run(
                "index_select",
                role=int(query.role or 0),
                now=live_at,
                pools=list(query.pools),
                engine_ids=ids[first : first + SELECT_STEP],
            )
            entries.extend(decode(record) for record in reply)

        async def probe(engines: Sequence[int], start: int, stop: int) -> list[int]:
            reply = await self._scripts.run(
                "index_match", members=chain[start:stop], engine_ids=[entries[i].engine_id for i in engines]
            )
            return [int(n) for n in reply]

        counts, depth = await leading_counts(len(entries), len(chain), max_lookups, probe)
        return answers(entries, counts, depth, query)

    async def drop(self, engine_id: str, incarnation: int) -> bool:
        reply = await self._write("index_drop", engine_id=engine_id, incarnation=incarnation)
        return bool(reply[0] == b"OK")

    async def total(self) -> int:
        return int(await self._command("GET", self._prefix + "ixt") or 0)
