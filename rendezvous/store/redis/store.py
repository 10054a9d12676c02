"""RedisStore: the Store interface over Redis (standalone, Sentinel, or one Cluster slot per namespace).

Records are hashes with a version (the global revision of the write that stored them); transitions
are compare-and-set Lua scripts (scripts/) that write a record, its indexes and its events at once;
each engine's events live in a Redis Stream whose entry ids are the engine's event sequences ("<sequence>-0").

update_transfer is optimistic (the loop in optimistic.py, shared with update_engine). It keeps the
versions of the records it last saw (cache.py); a transition is computed on them (or, for an id it never
saw, on "absent") and sent with one EVALSHA that checks the transfer's and its engines' versions before
writing. On a conflict the script answers the current state, and the transition is computed again, so the
common case costs one round trip. A transition that fails, or changes nothing, on a state not read in
this call is recomputed on a fresh read before its answer counts. Engine records are checked the same
way, so a transition sees the transfer and its engines as of one instant, as in the memory store.

update_transfers computes a whole batch on the records as last seen and sends it as one commit_transfers
call (the items as one JSON argument: a few arguments to pack and parse, not hundreds); the items it
refuses (a conflict) or could not compute on what was seen take update_transfer's loop. A batch RPC reads
its caller first (caller: the record, its live count and its owner's tallies, in one script), and its
response header takes the highest revision seen (answered_revision), which the commit's reply raised: two
round trips in all when the records are known. Other commands
that concurrent requests issue in one event-loop iteration go out as one pipeline (pipeliner.py). Every
write carries the epoch guard (epoch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

from rendezvous.core import budget
from rendezvous.core.limits import Limits
from rendezvous.core.model import Addressed, Engine, State, Transfer
from rendezvous.core.transfers import Transition
from rendezvous.pacing import Pacer
from rendezvous.protocol.errors import RendezvousError
from rendezvous.store._answers import answer_cost
from rendezvous.store.base import (
    CallerView,
    EngineFilter,
    EngineFn,
    EventPage,
    Store,
    StoreCounts,
    StoreUnavailableError,
    TransferFn,
)
from rendezvous.store.cache_index import IndexStore
from rendezvous.store.codec import encode_engine, encode_event, encode_transfer, event_around, to_json
from rendezvous.store.credits import CreditStore
from rendezvous.store.redis import optimistic
from rendezvous.store.redis.cache import ABSENT, EngineEntry, PeerCache, RecordCache, Snapshot, WrittenEvents
from rendezvous.store.redis.cache_index import RedisIndex
from rendezvous.store.redis.credits import RedisCredits
from rendezvous.store.redis.epoch import Epoch
from rendezvous.store.redis.errors import store_errors, unavailable
from rendezvous.store.redis.locks import KeyLocks
from rendezvous.store.redis.optimistic import Attempt, Reply
from rendezvous.store.redis.pipeliner import Pipeliner
from rendezvous.store.redis.scripts import Scripts
from rendezvous.store.redis.url import parse_url

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

_SCAN_COUNT = 1000
# Engine records read per script call while paging ListEngines or reading the sweeper's lapsed engines.
_ENGINE_CHUNK = 64
_TOMBSTONE_STATES = frozenset(s for s in State if s.terminal)
_EVERY_STATE = ",".join(str(int(s)) for s in sorted(State))
_APPEND_MEMORY_S = 300
# How long a due transfer handed to one sweeper is hidden from the others.
_SWEEP_HOLD_S = 5.0
# Longest single XREAD BLOCK: waits longer than this are several blocks, so close() is prompt.
_MAX_BLOCK_S = 1.0


def _tally(values: Sequence[Any], owner: str) -> budget.Tally:
    """The budget's tallies of a usage.lua reply (e, b, m of the namespace, then of owner)."""
    n = [int(v or 0) for v in values]
    mine = budget.Usage(*n[3:6]) if owner else budget.Usage()
    return budget.Tally(budget.Usage(*n[:3]), mine)


def _exhausted(reply: Sequence[Any]) -> RendezvousError:
    """The refusal a commit script answered B for: a budget the write would pass (B budget scope limit have adding)."""
    kind, scope, limit, have, adding = reply[1:6]
    return budget.exhausted(kind.decode(), scope.decode(), int(limit), int(have), int(adding))


def _no_peers() -> dict[str, int]:
    """The peers table of a commit_transfers call before any item: index 0 is "no peer"."""
    return {"": 0}


@dataclass(frozen=True, slots=True)
class _Plan:
    """A transition computed on a snapshot, and the commit_transfers item (commit_transfers.lua) that writes it."""

    transition: Transition
    unchanged: bool
    item: list[Any]


def _guarded(
    method: Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, R]]:
    """Bound a store call by op_timeout and map Redis failures (see errors.store_errors)."""

    @functools.wraps(method)
    async def guarded(self: RedisStore, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._redis is None:
            raise StoreUnavailableError("the Redis store is not open")
        limit = self.options.op_timeout
        try:
            with store_errors(limit):
                async with asyncio.timeout(limit):
                    return await method(self, *args, **kwargs)
        except StoreUnavailableError:
            self._drop_idle_connections()
            raise

    return cast("Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, R]]", guarded)


class RedisStore(Store):
    """The Store interface over Redis (standalone, Sentinel, or one Cluster slot per namespace)."""

    name = "redis"
    concurrent = True

    def __init__(
        self,
        url: str,
        max_events_per_engine: int = 100_000,
        limits: Limits | None = None,
        max_event_bytes_per_engine: int = 64 << 20,
        max_event_bytes_per_identity: int = 256 << 20,
        max_event_bytes_total: int = 1 << 30,
        max_answers_bytes: int = 256 << 20,
        max_answers_bytes_per_identity: int = 32 << 20,
    ) -> None:
        self.target = parse_url(url)
        # The engine budgets, checked again inside the script that writes an engine (commit_engine.lua), so
        # that replicas registering at once never pass them together.
        self._limits = limits or Limits()
        self.options = self.target.options
        self._max_events = max_events_per_engine
        self._max_event_bytes = max_event_bytes_per_engine
        self._max_owner_event_bytes = max_event_bytes_per_identity
        self._max_total_event_bytes = max_event_bytes_total
        self._max_answers_bytes = max_answers_bytes
        self._max_answers_bytes_per_identity = max_answers_bytes_per_identity
        self._prefix = "{" + self.options.prefix + "}:"
        self._rev_key = self._prefix + "rev"
        self._records = RecordCache(self.options.cache_size)
        self._peers = PeerCache()
        self._written_events = WrittenEvents()
        self._scripts = Scripts(self._rev_key, self._prefix)
        self._epoch = Epoch(
            self._prefix + "epoch",
            self._rev_key,
            self._scripts,
            self._records.clear,
            self._close_idle_connections if self.target.sentinels else None,
        )
        self._redis: aioredis.Redis | None = None
        self._pipeliner: Pipeliner | None = None
        self._health: aioredis.Redis | None = None
        self._watch: aioredis.Redis | None = None
        self._sentinels: list[Sentinel] = []
        self._dropping: asyncio.Task[None] | None = None
        self._watch_slots = asyncio.Semaphore(self.options.max_watch_connections)
        self._transfer_locks = KeyLocks()
        self._engine_locks = KeyLocks()

    # Connections

    def _client(self, max_connections: int, retries: int, socket_timeout: float | None = None) -> aioredis.Redis:
        kwargs = dict(self.target.connection)
        kwargs["max_connections"] = max_connections
        kwargs["retry"] = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries)
        if socket_timeout is not None:
            kwargs["socket_timeout"] = socket_timeout
        if self.options.cluster:
            # Every key of the namespace is in one slot: the client routes each call to its node.
            return RedisCluster.from_url(self.target.url, **kwargs)  # type: ignore[return-value]
        if not self.target.sentinels:
            pool = aioredis.ConnectionPool.from_url(self.target.url, **kwargs)
            return aioredis.Redis.from_pool(pool)
        sentinel_kwargs = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
        if self.target.sentinel_password is not None:
            sentinel_kwargs["password"] = self.target.sentinel_password
        sentinel = Sentinel(list(self.target.sentinels), sentinel_kwargs=sentinel_kwargs, **kwargs)  # type: ignore[no-untyped-call,unused-ignore]
        self._sentinels.append(sentinel)
        master: aioredis.Redis = sentinel.master_for(self.target.service, redis_class=aioredis.Redis)
        return master

    async def open(self) -> None:
        if self._redis is not None:
            return
        base_timeout = float(self.target.connection.get("socket_timeout") or 1.0)
        max_connections = int(self.target.connection["max_connections"])
        # A few connections more than batches may use, for the odd direct command (loading scripts).
        self._redis = self._client(max_connections + 4, self.options.retries)
        self._pipeliner = Pipeliner(self._redis, max_connections, self.options.wait_replicas, self.options.wait_timeout)
        self._scripts.bind(self._redis, self._pipeliner)
        self._health = self._client(2, 0)
        self._watch = self._client(self.options.max_watch_connections, 1, _MAX_BLOCK_S + base_timeout)
        try:
            async with asyncio.timeout(self.options.op_timeout):
                if self.options.cluster:
                    # Each cluster client learns every node now, while its seed answers: one that first
                    # connects after its seed died (a failover) would find no node at all.
                    for client in (self._health, self._watch):
                        await cast("RedisCluster", client).initialize()
                await self._scripts.load()
                await self._epoch.check(self._redis)
        except Exception as err:
            await self.close()
            if isinstance(err, TimeoutError) or unavailable(err):
                raise StoreUnavailableError(f"cannot reach Redis: {err}") from err
            raise

    async def close(self) -> None:
        if self._pipeliner is not None:
            await self._pipeliner.close()
            self._pipeliner = None
        clients = [c for c in (self._redis, self._health, self._watch) if c is not None]
        self._redis = self._health = self._watch = None
        self._scripts.unbind()
        for client in clients:
            await client.aclose()
        for sentinel in self._sentinels:
            for s in sentinel.sentinels:
                await s.aclose()
        self._sentinels.clear()

    async def ping(self) -> bool:
        if self._health is None:
            return False
        try:
            async with asyncio.timeout(self.options.ping_timeout):
                await self._epoch.check(self._health)
        except Exception:
            self._drop_idle_connections()
            return False
        return True

    def _drop_idle_connections(self) -> None:
        """With Sentinel, after a failure: close the idle connections of every pool, so each command afterwards
        connects to the master the Sentinels name then. An idle connection to a master that hung (SIGSTOP, a
        partition) would otherwise be used again when it resumes, before Sentinel demotes it: a split brain, where
        a write lands on the node about to be resynchronised and is lost (and its events seen by watchers)."""
        if not self.target.sentinels or (self._dropping is not None and not self._dropping.done()):
            return
        self._dropping = asyncio.get_running_loop().create_task(self._close_idle_connections())

    async def _close_idle_connections(self) -> None:
        for client in [c for c in (self._redis, self._health, self._watch) if c is not None]:
            with contextlib.suppress(Exception):
                await client.connection_pool.disconnect(inuse_connections=False)

    @property
    def epoch(self) -> int:
        return self._epoch.value

    # Calls

    async def _command(self, *args: Any) -> Any:
        assert self._pipeliner is not None
        return await self._pipeliner.call(*args)

    def _events(self, events: Sequence[Addressed], record: Transfer | None, record_json: str | None) -> list[Any]:
        """The events group of a script call: (engine id, event, peer engine or "") per event."""
        return [
            (
                addressed.engine_id,
                encode_event(
                    addressed.event,
                    record_json if record_json is not None and addressed.event.transfer is record else None,
                ),
                self._records.engine_json(addressed.event.peer),
            )
            for addressed in events
        ]

    # Engines

    @_guarded
    async def revision(self) -> int:
        rev = int(await self._command("GET", self._rev_key) or 0)
        self._epoch.saw(rev)
        return rev

    async def answered_revision(self) -> int:
        # Every write's reply shows its revision (Epoch.saw), so the highest seen covers this process's
        # writes without asking Redis; only a replica that has seen none yet asks.
        return self._epoch.high_rev or await self.revision()

    async def _read_engine(self, engine_id: str) -> EngineEntry:
        # A record remembered is checked by its version first (a few bytes), and read only if it moved on: a record
        # is mostly its agents (tens of KiB for TP 8), and a multi-rank engine's following ranks poll GetEngine twice
        # a renewal. Not one script: Lua copies the record in and out, dearer to Redis than sending it.
        key = self._prefix + "e:" + engine_id
        known = self._records.engine(engine_id)
        if known is not None and (await self._command("HGET", key, "v") or ABSENT) == known.version:
            return known
        version, data = await self._command("HMGET", key, "v", "d")
        return self._records.seen_engine(engine_id, version or ABSENT, data or b"")

    @_guarded
    async def get_engine(self, engine_id: str) -> Engine | None:
        return (await self._read_engine(engine_id)).engine

    @_guarded
    async def caller(self, engine_id: str, live: bool = False, usage: bool = False) -> CallerView:
        if not (live or usage):
            return CallerView((await self._read_engine(engine_id)).engine)
        # One script reads the record, the count and the tallies of the owner it names (the record's `o`).
        reply = await self._scripts.run("read_caller", engine_id=engine_id, live=int(live), usage=int(usage))
        engine = self._records.seen_engine(engine_id, reply[0] or ABSENT, reply[1] or b"").engine
        count = int(reply[3]) if live else None
        tally: budget.Tally | None = None
        if usage and engine is not None:
            owner = reply[2].decode()
            # The index field and the record agree (one script writes both); should they not, the record counts.
            tally = _tally(reply[4:], owner) if owner == engine.owner else await self.usage(engine.owner)
        return CallerView(engine, count, tally)

    def _engines_in(self, reply: Sequence[Any]) -> list[Engine]:
        """The engines of a listing reply; a record that cannot be decoded is logged and left out, so
        one bad record cannot stop listings and sweeps for every other engine."""
        engines = []
        for i in range(0, len(reply), 3):
            engine_id = reply[i].decode(errors="replace")
            try:
                engine = self._records.seen_engine(engine_id, reply[i + 1], reply[i + 2]).engine
            except Exception:
                log.exception("undecodable engine record", extra={"engine_id": engine_id})
                continue
            if engine is not None:
                engines.append(engine)
        return engines

    @_guarded
    async def page_engines(self, after: str, limit: int, keep: EngineFilter) -> list[Engine]:
        # A few records at a time (an engine's record may be megabytes of agent metadata), in id order from
        # the id index, until the page is full: a page costs its own size, not the fleet's.
        page: list[Engine] = []
        chunk = min(limit, _ENGINE_CHUNK)
        while len(page) < limit:
            reply = await self._scripts.run("page_engines", after=after, count=chunk)
            after = reply[0].decode()
            if not after:
                break
            page += [e for e in self._engines_in(reply[1:]) if keep(e)]
        return page[:limit]

    @_guarded
    async def update_engine(self, engine_id: str, fn: EngineFn) -> Engine | None:
        async with self._engine_locks.hold(engine_id):
            return await self._update_engine(engine_id, fn)

    async def _update_engine(self, engine_id: str, fn: EngineFn) -> Engine | None:
        limits = self._limits
        entry = self._records.engine(engine_id)
        fresh = entry is None
        if entry is None:
            entry = await self._read_engine(engine_id)

        def compute(entry: EngineEntry) -> Attempt[Engine | None]:
            cur = entry.engine
            new = fn(cur)
            op = "n" if new is cur else ("d" if new is None else "w")
            record = encode_engine(new) if op == "w" and new is not None else ""
            charge = budget.engine_usage(new)

            async def commit() -> Any:  # the script's reply
                reply = await self._scripts.run(
                    "commit_engine",
                    guard=self._epoch.guard,
                    engine_id=engine_id,
                    version=entry.version,
                    op=op,
                    record=record,
                    ended=1 if new is not None and new.ended_at else 0,
                    lease_expires_at=new.lease_expires_at if new is not None else 0,
                    ended_at=new.ended_at if new is not None else 0,
                    owner=new.owner if new is not None else "",
                    engines=charge.engines,
                    metadata_bytes=charge.metadata_bytes,
                    max_engines=limits.max_engines,
                    max_engines_per_identity=limits.max_engines_per_identity,
                    max_metadata_bytes=limits.max_agent_metadata_bytes_total,
                    max_metadata_bytes_per_identity=limits.max_agent_metadata_bytes_per_identity,
                )
                if reply[0] == b"B":
                    raise _exhausted(reply)
                return reply

            def written(reply: Reply) -> None:
                remembered = EngineEntry(b"%d" % reply[1] if new is not None else ABSENT, new)
                remembered.encoded = record or None
                self._records.remember_engine(engine_id, remembered)

            return Attempt(new, new is cur, commit, written)

        return await optimistic.update(
            self._epoch,
            entry,
            fresh,
            lambda: self._read_engine(engine_id),
            compute,
            lambda reply: self._records.seen_engine(engine_id, reply[1], reply[2]),
        )

    @_guarded
    async def lapse_candidates(self, now: float, tombstone_ttl: float) -> list[Engine]:
        # By index: leases expired by now, and tombstones ended by the cutoff (with a little slack); their ids, then
        # their records _ENGINE_CHUNK at a time: after an outage longer than the leases the whole fleet lapses at
        # once, and one reply of every record (megabytes of agent metadata each) would hold Redis for every replica.
        found = await self._scripts.run("lapse_candidates", now=now, tombstone_cutoff=now - tombstone_ttl + 1e-3)
        ids = list(dict.fromkeys(engine_id.decode() for engine_id in found))
        engines: list[Engine] = []
        for start in range(0, len(ids), _ENGINE_CHUNK):
            engines += self._engines_in(await self._scripts.run("read_engines", ids=ids[start : start + _ENGINE_CHUNK]))
        return engines

    # Transfers

    @_guarded
    async def get_transfer(self, transfer_id: str) -> Transfer | None:
        version, data = await self._command("HMGET", self._prefix + "t:" + transfer_id, "v", "d")
        return self._records.seen_transfer(version, data, transfer_id)

    @_guarded
    async def update_transfer(self, transfer_id: str, fn: TransferFn) -> Transition:
        async with self._transfer_locks.hold(transfer_id):
            return await self._update_transfer(transfer_id, fn)

    async def _read_transfer(self, transfer_id: str) -> Snapshot:
        return self._records.snapshot(transfer_id, await self._scripts.run("read_transfer", transfer_id=transfer_id), 0)

    def _plan(self, transfer_id: str, fn: TransferFn, snapshot: Snapshot, peers: dict[str, int]) -> _Plan | None:
        """fn's transition on snapshot, with the commit_transfers item that writes it; None when an engine the
        transfer names was never seen (read them first). Its events name their peers by index in peers (the
        encoded peer engines of one call, each sent once: a batch's assignments mostly carry the same one)."""
        entries = self._records.engines_of(snapshot)
        if entries is None:
            return None
        cur = snapshot.transfer
        transition = fn(cur, {e: entry.engine for e, entry in entries.items() if entry.engine is not None})
        new = transition.transfer
        unchanged = new is cur and not transition.events
        checks: list[str] = []
        for engine_id, entry in entries.items():
            checks += (engine_id, entry.version.decode())
        version = snapshot.version.decode()
        if unchanged:
            return _Plan(transition, True, [transfer_id, version, "n", "", "", "", "0", "0", "0", "0", "0", checks, []])
        events: list[Any] = []
        record: str | None = None
        if new is None:
            item = [transfer_id, version, "d", "", "", "", "0", "0", "0", "0", "0", checks, events]
        else:
            record = encode_transfer(new)
            target_blocks, source_blocks = budget.transfer_blocks(new)
            item = [
                transfer_id,
                version,
                "w",
                record,
                new.consumer_engine_id,
                new.producer_engine_id,
                str(int(new.state)),
                "1" if new.unsettled else "0",
                repr(new.deadline),
                str(target_blocks),
                str(source_blocks),
                checks,
                events,
            ]
        engine_json = self._records.engine_json
        for addressed in transition.events:
            event = addressed.event
            sent: str | tuple[str, str]
            if record is not None and event.transfer is new:
                # Its text around the item's record, which the script puts in between: the record goes once.
                sent = event_around(event)
                encoded = sent[0] + record + sent[1]
            else:
                sent = encoded = encode_event(event)
            self._written_events.wrote(encoded, event)
            events += (addressed.engine_id, sent, peers.setdefault(engine_json(event.peer), len(peers)))
        return _Plan(transition, False, item)

    async def _commit(self, items: Sequence[list[Any]], peers: dict[str, int]) -> Reply:
        """Run commit_transfers (peers: the items' peers by index, _plan): OK and one answer per item, or the
        guard's refusal."""
        reply: Reply = await self._scripts.run(
            "commit_transfers",
            guard=self._epoch.guard,
            max_events=self._max_events,
            max_event_bytes=self._max_event_bytes,
            max_owner_event_bytes=self._max_owner_event_bytes,
            max_total_event_bytes=self._max_total_event_bytes,
            max_blocks=self._limits.max_live_blocks,
            max_blocks_per_identity=self._limits.max_live_blocks_per_identity,
            items=to_json([list(peers), items]),  # records inside are JSON text, passed as strings
        )
        return reply

    def _written(self, transfer_id: str, transition: Transition, answer: Reply) -> None:
        """Remember what a commit wrote (answer: its OK and revision)."""
        new = transition.transfer
        self._records.remember_transfer(transfer_id, Snapshot(b"%d" % answer[1] if new is not None else ABSENT, new))

    async def _update_transfer(self, transfer_id: str, fn: TransferFn) -> Transition:
        def compute(snapshot: Snapshot) -> Attempt[Transition] | None:
            peers = _no_peers()
            plan = self._plan(transfer_id, fn, snapshot, peers)
            if plan is None:
                return None

            async def commit() -> Reply:
                reply = await self._commit([plan.item], peers)
                if reply[0] != b"OK":
                    return reply
                answer: Reply = reply[1]
                if answer[0] == b"B":
                    raise _exhausted(answer)
                return answer

            return Attempt(
                plan.transition, plan.unchanged, commit, functools.partial(self._written, transfer_id, plan.transition)
            )

        return await optimistic.update(
            self._epoch,
            self._records.transfer(transfer_id),
            False,
            lambda: self._read_transfer(transfer_id),
            compute,
            lambda reply: self._records.snapshot(transfer_id, reply, 1),
        )

    @_guarded
    async def update_transfers(self, updates: Sequence[tuple[str, TransferFn]]) -> list[Transition | Exception]:
        # Every transition is computed on the records as last seen and all go in one commit_transfers call;
        # the few it cannot settle (a conflict, a record never seen, a refusal to check afresh) then take the
        # optimistic loop of update_transfer, in flight together (pipelined). Updates of one transfer apply
        # in turn instead.
        ids = [transfer_id for transfer_id, _ in updates]
        if len(set(ids)) < len(ids):
            return await super().update_transfers(updates)
        async with self._transfer_locks.hold_all(ids):
            return await self._update_transfers(updates)

    async def _update_transfers(self, updates: Sequence[tuple[str, TransferFn]]) -> list[Transition | Exception]:
        results: list[Transition | Exception | None] = [None] * len(updates)
        plans: list[tuple[int, _Plan]] = []
        again: list[int] = []
        peers = _no_peers()
        pacer = Pacer()  # planning is CPU only: give the event loop back between items (rendezvous.pacing)
        for i, (transfer_id, fn) in enumerate(updates):
            await pacer.tick()
            try:
                plan = self._plan(transfer_id, fn, self._records.transfer(transfer_id), peers)
            except Exception:
                plan = None  # computed on a remembered record: its answer counts only on a fresh read
            if plan is None:
                again.append(i)
            else:
                plans.append((i, plan))
        if plans:
            reply = await self._commit([plan.item for _, plan in plans], peers)
            if reply[0] != b"OK":
                await self._epoch.refused(reply)
                again += (i for i, _ in plans)
            else:
                for (i, plan), answer in zip(plans, reply[1:], strict=True):
                    if answer[0] == b"OK":
                        self._epoch.saw(answer[1])
                        self._written(updates[i][0], plan.transition, answer)
                        results[i] = plan.transition
                    elif answer[0] == b"N":
                        results[i] = plan.transition
                    elif answer[0] == b"B":
                        results[i] = _exhausted(answer)
                    else:  # a conflict: the answer holds the current records
                        self._records.snapshot(updates[i][0], answer, 1)
                        again.append(i)
        if again:
            redone = await asyncio.gather(*(self._redo(*updates[i]) for i in again))
            for i, result in zip(again, redone, strict=True):
                results[i] = result
        return cast("list[Transition | Exception]", results)

    async def _redo(self, transfer_id: str, fn: TransferFn) -> Transition | Exception:
        """update_transfer under the lock already held: its transition, or the error fn (or a record) raised."""
        try:
            return await self._update_transfer(transfer_id, fn)
        except (StoreUnavailableError, rex.RedisError, OSError):
            raise
        except Exception as err:
            return err

    def _transfers_in(self, reply: Sequence[Any], offset: int = 0) -> list[Transfer]:
        transfers = []
        for i in range(offset, len(reply), 2):
            transfer = self._records.seen_transfer(reply[i], reply[i + 1])
            assert transfer is not None
            transfers.append(transfer)
        return transfers

    @_guarded
    async def list_transfers(self, engine_id: str | None = None) -> list[Transfer]:
        if engine_id is not None:
            # No serving path lists an engine's whole history (ListTransfers pages, page_transfers): its ids in SSCAN
            # steps and its records a chunk a script call, so that a long history never holds Redis for long.
            ids = await self._set_members(self._prefix + "et:" + engine_id)
            return await self._select(ids, _EVERY_STATE, len(ids), 4096)
        # SSCAN in pages, so a large namespace never blocks Redis for long; a set may repeat ids.
        found: dict[str, Transfer] = {}
        cursor: bytes | int = 0
        while True:
            reply = await self._scripts.run("scan_transfers", cursor=cursor, count=_SCAN_COUNT)
            for t in self._transfers_in(reply, 1):
                found[t.transfer_id] = t
            cursor = reply[0]
            if cursor in (b"0", 0):
                return list(found.values())

    @_guarded
    async def live_transfer_ids(self, engine_id: str) -> list[str]:
        return [m.decode() for m in await self._command("SMEMBERS", self._prefix + "el:" + engine_id)]

    @_guarded
    async def live_transfer_counts(self, engine_ids: Sequence[str]) -> dict[str, int]:
        # Issued together, the SCARDs go out as one pipeline: one round trip for every engine.
        sizes = await asyncio.gather(*(self._command("SCARD", self._prefix + "el:" + e) for e in engine_ids))
        return {engine_id: int(n) for engine_id, n in zip(engine_ids, sizes, strict=True)}

    async def _set_members(self, key: str) -> list[str]:
        """A set's members, read in SSCAN pages so that a large set never blocks Redis for long."""
        members: set[str] = set()  # SSCAN may repeat a member
        cursor: Any = 0
        while True:
            cursor, page = await self._command("SSCAN", key, cursor, "COUNT", _SCAN_COUNT)
            members.update(m.decode() for m in page)
            if int(cursor) == 0:
                return list(members)

    async def _index_transfers(self) -> None:
        """Bring the id indexes of ListTransfers up to date with the `transfers` set (index_transfers.lua): for a
        namespace written before them, or by an older replica during a rolling upgrade. A chunk per call."""
        log.info("indexing the transfer ids of the Redis namespace for ListTransfers")
        cursor: Any = "0"
        while True:
            cursor = await self._scripts.run("index_transfers", cursor=cursor, after="", count=_SCAN_COUNT)
            if cursor in (b"0", 0):
                break
        after: Any = ""
        while True:
            after = await self._scripts.run("index_transfers", cursor="", after=after, count=_SCAN_COUNT)
            if not after:
                return

    @_guarded
    async def page_transfers(
        self, engine_id: str | None, states: AbstractSet[State], after: str, limit: int
    ) -> list[Transfer]:
        # Ids from the page token on, then the records of the first candidates, chunk by chunk, until the page
        # is full: a script skips the ones in other states by their `s` field, so only the page's records are
        # sent and decoded. Over all engines, the ids come from an id index in Redis (about a page a call); for
        # one engine, from its set (its live transfers, or all of its transfers), read and sorted here.
        if limit <= 0 or not states:
            return []
        wanted = ",".join(str(int(s)) for s in sorted(states))
        chunk = min(max(2 * limit, 256), 4096)
        page: list[Transfer] = []
        if engine_id is None:
            # From an id index (page_transfers.lua): about a page of ids looked at per call, not every id.
            live = "1" if states.isdisjoint(_TOMBSTONE_STATES) else "0"
            check = "1"
            while True:
                reply = await self._scripts.run(
                    "page_transfers",
                    check=check,
                    live=live,
                    states=wanted,
                    after=after,
                    limit=limit - len(page),
                    count=chunk,
                )
                if reply == [b"I"]:  # the indexes need bringing up to date: once, then the page is read from them
                    await self._index_transfers()
                    check = "0"
                    continue
                page += self._transfers_in(reply, 1)
                after = reply[0].decode()
                if len(page) >= limit or not after:
                    return page
        key = ("el:" if states.isdisjoint(_TOMBSTONE_STATES) else "et:") + engine_id
        ids = sorted(tid for tid in await self._set_members(self._prefix + key) if tid > after)
        return await self._select(ids, wanted, limit, chunk)

    async def _select(self, ids: Sequence[str], wanted: str, limit: int, chunk: int) -> list[Transfer]:
        """The first limit transfers of ids (in their order) that exist in one of the states wanted ("1,2,..."),
        read chunk ids a script call (select_transfers.lua) until there are limit."""
        found: list[Transfer] = []
        for start in range(0, len(ids), chunk):
            if len(found) >= limit:
                break
            reply = await self._scripts.run(
                "select_transfers", states=wanted, limit=limit - len(found), ids=ids[start : start + chunk]
            )
            found += self._transfers_in(reply)
        return found

    @_guarded
    async def due_transfers(self, now: float, limit: int) -> list[str]:
        if limit <= 0:
            return []
        reply = await self._scripts.run("due_transfers", now=now, limit=limit, hold_until=now + _SWEEP_HOLD_S)
        return [tid.decode() for tid in reply]

    # Events

    @_guarded
    async def append_events(self, events: Sequence[Addressed]) -> None:
        # The operation id makes a retried call (reply lost) apply once.
        operation = secrets.token_hex(12)
        for _ in range(3):
            reply = await self._scripts.run(
                "append_events",
                guard=self._epoch.guard,
                operation=operation,
                remember_s=_APPEND_MEMORY_S,
                max_events=self._max_events,
                max_event_bytes=self._max_event_bytes,
                max_owner_event_bytes=self._max_owner_event_bytes,
                max_total_event_bytes=self._max_total_event_bytes,
                events=self._events(events, None, None),
            )
            if reply[0] == b"OK":
                self._epoch.saw(reply[1])
            if reply[0] not in (b"E", b"R"):
                return
            await self._epoch.refused(reply)
        raise StoreUnavailableError("the store epoch keeps changing")

    @_guarded
    async def read_events(self, engine_id: str, start_sequence: int, limit: int) -> EventPage:
        reply = await self._scripts.run("read_events", engine_id=engine_id, start_sequence=start_sequence, limit=limit)
        # The store's revision, read with the events: a response that carries them answers at least it.
        self._epoch.saw(reply[0])
        last = int(reply[1])
        if len(reply) == 2:
            return EventPage((), last, forgotten=True)
        if reply[2] == 1:
            return EventPage((), last, resync_sequence=last + 1)
        events = [
            self._written_events.read(
                reply[i + 1],
                int(reply[i].partition(b"-")[0]),
                self._peers.peer(reply[i + 2]) if reply[i + 2] else None,
            )
            for i in range(3, len(reply), 3)
        ]
        return EventPage(events, last)

    async def wait_events(self, engine_id: str, after_sequence: int, timeout: float) -> None:
        # Not _guarded: its time limit is the wait's own plus op_timeout.
        watch = self._watch
        if watch is None:
            raise StoreUnavailableError("the Redis store is not open")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        stream: dict[Any, Any] = {self._prefix + "s:" + engine_id: f"{max(after_sequence, 0)}-0"}
        limit = max(timeout, 0) + self.options.op_timeout
        with store_errors(limit):
            async with asyncio.timeout(limit):
                while (left := deadline - loop.time()) > 0:
                    if self._watch_slots.locked():
                        # Every watch connection is busy: poll instead of opening more.
                        await asyncio.sleep(min(left, 0.05))
                        return
                    async with self._watch_slots:
                        block_ms = max(1, int(min(left, _MAX_BLOCK_S) * 1000))
                        if await watch.xread(stream, count=1, block=block_ms):
                            return

    @_guarded
    async def last_event_sequence(self, engine_id: str) -> int:
        return int(await self._command("HGET", self._prefix + "e:" + engine_id, "r") or 0)

    # Responses and counts

    @_guarded
    async def get_response(self, key: str) -> bytes | None:
        value: bytes | None = await self._command("GET", self._prefix + "r:" + key)
        return value

    @_guarded
    async def put_response(self, key: str, value: bytes, ttl: float, owner: str = "") -> None:
        reply = await self._scripts.run(
            "put_answer",
            guard=self._epoch.guard,
            key=key,
            value=value,
            ttl_ms=max(1, int(ttl * 1000)),
            owner=owner,
            cost=answer_cost(key, value),
            max_bytes=self._max_answers_bytes,
            max_owner_bytes=self._max_answers_bytes_per_identity,
        )
        if isinstance(reply, list):
            # The guard refused: the answer's write was in an epoch that has ended, so it is not kept (a retry
            # runs again in the new one, which this replica now follows); not retried, unlike other writes.
            await self._epoch.refused(reply)

    @_guarded
    async def answer_bytes(self, owner: str) -> tuple[int, int]:
        total, mine = await self._command("HMGET", self._prefix + "rt", "t", "o:" + owner)
        return int(total or 0), int(mine or 0) if owner else 0

    @_guarded
    async def event_log_bytes(self, engine_id: str) -> int:
        return int(await self._command("HGET", self._prefix + "e:" + engine_id, "b") or 0)

    @_guarded
    async def usage(self, owner: str) -> budget.Tally:
        return _tally(await self._scripts.run("usage", owner=owner), owner)

    @_guarded
    async def page_token_key(self) -> bytes:
        # The first replica to ask makes the namespace's key (SET NX); every replica reads the one that won.
        name = self._prefix + "page-key"
        await self._command("SET", name, secrets.token_bytes(32), "NX")
        return bytes(await self._command("GET", name))

    @_guarded
    async def counts(self) -> StoreCounts:
        reply = await self._scripts.run("counts")
        by_state: Counter[State] = Counter()
        for i in range(1, len(reply), 2):
            n, state = int(reply[i + 1]), State(int(reply[i]))
            if n > 0 and not state.terminal:  # tombstones are counted in Redis, but are not live
                by_state[state] = n
        return StoreCounts(int(reply[0]), by_state)

    def credits(self) -> CreditStore:
        """Reservations in this store's namespace (rendezvous.store.redis.credits), made on first use."""
        ledger: CreditStore | None = getattr(self, "_credits", None)
        if ledger is None:
            ledger = self._credits = RedisCredits(self._prefix, self._scripts, self._epoch, self._command)
        return ledger

    def index(self) -> IndexStore:
        """The KV index in this store's namespace (rendezvous.store.redis.cache_index), made on first use."""
        kept: IndexStore | None = getattr(self, "_kv_index", None)
        if kept is None:
            kept = self._kv_index = RedisIndex(self._prefix, self._scripts, self._epoch, self._command)
        return kept


__all__ = ["RedisStore"]
