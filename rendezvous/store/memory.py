"""The in-memory store: one process, fastest, soft state (a restart changes the epoch).

Every method runs without awaiting between its read and its write, so on one event loop each
transition is atomic without locks.
"""

from __future__ import annotations

import asyncio
import heapq
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet

from rendezvous.core import budget
from rendezvous.core.limits import Limits
from rendezvous.core.model import Addressed, Engine, State, Transfer, evolve
from rendezvous.core.transfers import Transition
from rendezvous.store._answers import Answers
from rendezvous.store._event_logs import EventLogs
from rendezvous.store._sorted import SortedIds
from rendezvous.store.base import EngineFilter, EngineFn, EventPage, Store, StoreCounts, TransferFn
from rendezvous.store.cache_index import IndexStore, MemoryIndex
from rendezvous.store.credits import CreditStore, MemoryCredits

_TOMBSTONE_STATES = frozenset(s for s in State if s.terminal)

_ChargeKey = tuple[str, int, str, int]
"""What a transfer record charges the live-block budget: (consumer id, target block ids, producer id, source
block ids); a side without block ids has id ""."""
_Charge = tuple[_ChargeKey, str, str]
"""A charge as kept: its key, the consumer's owner, the producer's owner."""


def _charge_key(t: Transfer | None) -> _ChargeKey | None:
    """What t charges (rendezvous.core.budget.transfer_blocks), None for nothing."""
    target, source = budget.transfer_blocks(t)
    if t is None or not (target or source):
        return None
    return (t.consumer_engine_id if target else "", target, t.producer_engine_id if source else "", source)


class MemoryStore(Store):
    """Dicts, id-ordered indexes, a deadline heap and bounded event logs (rendezvous.store._event_logs)."""

    name = "memory"

    def __init__(
        self,
        max_events_per_engine: int = 100_000,
        max_event_bytes_per_engine: int = 64 << 20,
        max_event_bytes_per_identity: int = 256 << 20,
        max_event_bytes_total: int = 1 << 30,
        max_answers_bytes: int = 256 << 20,
        max_answers_bytes_per_identity: int = 32 << 20,
        limits: Limits | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """clock: the seconds kept answers' TTLs run on, a monotonic clock by default (a test's fake clock moves
        them without sleeping)."""
        self._limits = limits or Limits()  # the live-block budget, checked again as a write applies
        self._clock = clock or time.monotonic
        self._epoch = secrets.randbits(63) or 1
        self._page_key = secrets.token_bytes(32)  # one process is the deployment
        self._revision = 0
        self._engines: dict[str, Engine] = {}
        self._engine_ids = SortedIds()  # for paging ListEngines
        self._transfers: dict[str, Transfer] = {}
        self._live_by_engine: dict[str, set[str]] = {}
        # Id order, for paging (_order keeps them): every transfer, the live ones, each engine's.
        self._ids = SortedIds()
        self._live_ids = SortedIds()
        self._ids_by_engine: dict[str, SortedIds] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._logs = EventLogs(
            max_events_per_engine, max_event_bytes_per_engine, max_event_bytes_per_identity, max_event_bytes_total
        )
        self._answers = Answers(max_answers_bytes, max_answers_bytes_per_identity)
        # The memory budget's tallies (rendezvous.core.budget), as plain counters: what each record charges
        # (kept, so that a change takes back exactly that, from the owner it charged), and the sums, over all
        # and by owner, as [engines, block ids, metadata bytes].
        self._engine_charges: dict[str, tuple[str, int, int]] = {}
        # A transfer's (_Charge): its _charge_key, the consumer's owner and the producer's owner.
        self._transfer_charges: dict[str, _Charge] = {}
        self._total = [0, 0, 0]
        self._by_owner: dict[str, list[int]] = {}

    @property
    def epoch(self) -> int:
        return self._epoch

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ping(self) -> bool:
        return True

    async def revision(self) -> int:
        return self._revision

    async def get_engine(self, engine_id: str) -> Engine | None:
        return self._engines.get(engine_id)

    async def page_engines(self, after: str, limit: int, keep: EngineFilter) -> list[Engine]:
        page: list[Engine] = []
        if limit <= 0:
            return page
        for engine_id in self._engine_ids.after(after):
            engine = self._engines[engine_id]
            if keep(engine):
                page.append(engine)
                if len(page) == limit:
                    break
        return page

    async def update_engine(self, engine_id: str, fn: EngineFn) -> Engine | None:
        new = fn(self._engines.get(engine_id))
        self._revision += 1
        self._charge_engine(engine_id, new)
        if new is None:
            self._engines.pop(engine_id, None)
            self._engine_ids.discard(engine_id)
            self._logs.drop(engine_id)
            return None
        self._engines[engine_id] = new
        self._engine_ids.add(engine_id)
        self._logs.open(engine_id, new.owner)
        return new

    async def lapse_candidates(self, now: float, tombstone_ttl: float) -> list[Engine]:
        # No index: every record is a candidate (the sweeper's core rule picks the lapsed ones).
        return list(self._engines.values())

    async def get_transfer(self, transfer_id: str) -> Transfer | None:
        return self._transfers.get(transfer_id)

    async def update_transfer(self, transfer_id: str, fn: TransferFn) -> Transition:
        cur = self._transfers.get(transfer_id)
        engines: dict[str, Engine] = {}
        if cur is not None:
            known = self._engines
            for engine_id in cur.participants():
                engine = known.get(engine_id)
                if engine is not None:
                    engines[engine_id] = engine
        transition = fn(cur, engines)
        new = transition.transfer
        if new is cur and not transition.events:
            return transition
        # The live-block budget: most writes keep the charge they had (a transfer's block ids change at its
        # target and source calls, and when it ends); a new one is checked before anything is written.
        old = self._transfer_charges.get(transfer_id)
        key = _charge_key(new)
        recharge = old[0] != key if old is not None else key is not None
        charge = None
        if recharge:
            charge = self._charge_of(key)
            self._check_blocks(old, charge)
        self._revision += 1
        if recharge:
            self._recharge(transfer_id, old, charge)
        self._index(cur, new)
        self._order(cur, new)
        if new is None:
            self._transfers.pop(transfer_id, None)
        else:
            self._transfers[transfer_id] = new
            if cur is None or new.deadline != cur.deadline:
                heapq.heappush(self._deadlines, (new.deadline, transfer_id))
                if len(self._deadlines) > 2 * len(self._transfers) + 1_024:
                    self._compact_deadlines()
        self._append(transition.events)
        return transition

    def _owner(self, engine_id: str) -> str:
        engine = self._engines.get(engine_id) if engine_id else None
        return engine.owner if engine is not None else ""

    def _add(self, owner: str, kind: int, n: int) -> None:
        """Add n (maybe negative) to a kind of the sums (0 engines, 1 block ids, 2 metadata bytes)."""
        if not n:
            return
        self._total[kind] += n
        if owner:
            mine = self._by_owner.get(owner)
            if mine is None:
                mine = self._by_owner[owner] = [0, 0, 0]
            mine[kind] += n
            if not any(mine):
                del self._by_owner[owner]

    def _charge_engine(self, engine_id: str, new: Engine | None) -> None:
        usage = budget.engine_usage(new)
        charge = (new.owner, usage.engines, usage.metadata_bytes) if new is not None and usage.engines else None
        old = self._engine_charges.pop(engine_id, None)
        if charge is not None:
            self._engine_charges[engine_id] = charge
        if old == charge:
            return
        for sign, c in ((-1, old), (1, charge)):
            if c is not None:
                self._add(c[0], 0, sign * c[1])
                self._add(c[0], 2, sign * c[2])

    def _charge_of(self, key: _ChargeKey | None) -> _Charge | None:
        """A transfer's charge of key (see `_charge_key`), with the owners it goes to."""
        return (key, self._owner(key[0]), self._owner(key[2])) if key is not None else None

    def _check_blocks(self, old: _Charge | None, new: _Charge | None) -> None:
        """Refuse (BUDGET_EXHAUSTED) a write that takes the live-block budget past a limit, by the tallies as
        they are now. The coordinator checks a batch by the tallies read as it starts, and the batches of
        requests in flight together interleave between their items (rendezvous.pacing): as the Redis script
        does, the write that would pass the budget is refused, whichever batch it belongs to."""
        if new is None:
            return  # frees what it held
        (_, target, _, source), consumer_owner, producer_owner = new
        charges = [(consumer_owner, target), (producer_owner, source)]
        if old is not None:
            charges += [(old[1], -old[0][1]), (old[2], -old[0][3])]
        grow: dict[str, int] = {}
        for owner, n in charges:
            grow[owner] = grow.get(owner, 0) + n
        limits = self._limits
        total = sum(grow.values())
        if total > 0 and self._total[1] + total > limits.max_live_blocks:
            raise budget.exhausted(budget.LIVE_BLOCKS, "server", limits.max_live_blocks, self._total[1], total)
        for owner, n in grow.items():
            have = self._by_owner.get(owner, (0, 0, 0))[1] if owner else 0
            if owner and n > 0 and have + n > limits.max_live_blocks_per_identity:
                raise budget.exhausted(budget.LIVE_BLOCKS, "identity", limits.max_live_blocks_per_identity, have, n)

    def _recharge(self, transfer_id: str, old: _Charge | None, new: _Charge | None) -> None:
        """Replace a transfer's charge in the tallies."""
        if new is not None:
            self._transfer_charges[transfer_id] = new
            self._add(new[1], 1, new[0][1])
            self._add(new[2], 1, new[0][3])
        else:
            self._transfer_charges.pop(transfer_id, None)
        if old is not None:
            self._add(old[1], 1, -old[0][1])
            self._add(old[2], 1, -old[0][3])

    async def usage(self, owner: str) -> budget.Tally:
        mine = self._by_owner.get(owner) if owner else None
        return budget.Tally(budget.Usage(*self._total), budget.Usage(*mine) if mine else budget.Usage())

    def _compact_deadlines(self) -> None:
        """Rebuild the deadline heap from the records: one entry each. A deadline that moves leaves its old
        entry behind (skipped when popped), and a lifecycle moves it three times (target, commit, release), so
        without this the heap would hold entries of transfers long forgotten until their old deadlines passed
        (release_timeout: minutes). Amortised O(1) per push: it runs once the heap is twice the records."""
        self._deadlines = [(t.deadline, tid) for tid, t in self._transfers.items()]
        heapq.heapify(self._deadlines)

    def _index(self, cur: Transfer | None, new: Transfer | None) -> None:
        before = cur.participants() if cur is not None and cur.unsettled else ()
        after = new.participants() if new is not None and new.unsettled else ()
        if before == after:  # most transitions: the same engines stay tied up
            return
        tid = (cur or new).transfer_id  # type: ignore[union-attr]
        for engine_id in set(before) - set(after):
            ids = self._live_by_engine.get(engine_id)
            if ids is not None:
                ids.discard(tid)
                if not ids:
                    del self._live_by_engine[engine_id]
        for engine_id in set(after) - set(before):
            self._live_by_engine.setdefault(engine_id, set()).add(tid)

    async def list_transfers(self, engine_id: str | None = None) -> list[Transfer]:
        if engine_id is None:
            return list(self._transfers.values())
        return [t for t in self._transfers.values() if engine_id in t.participants()]

    async def live_transfer_ids(self, engine_id: str) -> list[str]:
        return list(self._live_by_engine.get(engine_id, ()))

    async def live_transfer_counts(self, engine_ids: Sequence[str]) -> dict[str, int]:
        return {engine_id: len(self._live_by_engine.get(engine_id, ())) for engine_id in engine_ids}

    def _order(self, cur: Transfer | None, new: Transfer | None) -> None:
        """Keep the id-ordered indexes that page_transfers reads."""
        tid = (cur or new).transfer_id  # type: ignore[union-attr]
        if cur is None:
            self._ids.add(tid)
        elif new is None:
            self._ids.discard(tid)
        was_live = cur is not None and not cur.state.terminal
        is_live = new is not None and not new.state.terminal
        if is_live and not was_live:
            self._live_ids.add(tid)
        elif was_live and not is_live:
            self._live_ids.discard(tid)
        before = cur.participants() if cur is not None else ()
        after = new.participants() if new is not None else ()
        if before == after:
            return
        for engine_id in set(before) - set(after):
            ids = self._ids_by_engine.get(engine_id)
            if ids is not None:
                ids.discard(tid)
                if not ids:
                    del self._ids_by_engine[engine_id]
        for engine_id in set(after) - set(before):
            self._ids_by_engine.setdefault(engine_id, SortedIds()).add(tid)

    async def page_transfers(
        self, engine_id: str | None, states: AbstractSet[State], after: str, limit: int
    ) -> list[Transfer]:
        # Walk the smallest index that holds every candidate, from `after` on, and stop at a full page.
        page: list[Transfer] = []
        if limit <= 0 or not states:
            return page
        ids: Iterable[str]
        if not states.isdisjoint(_TOMBSTONE_STATES):
            index = self._ids if engine_id is None else self._ids_by_engine.get(engine_id)
            ids = index.after(after) if index is not None else ()
        elif engine_id is None:
            ids = self._live_ids.after(after)
        else:  # an engine's live transfers are few (max_live_transfers_per_engine)
            ids = sorted(tid for tid in self._live_by_engine.get(engine_id, ()) if tid > after)
        for tid in ids:
            t = self._transfers[tid]
            if t.state in states:
                page.append(t)
                if len(page) == limit:
                    break
        return page

    async def due_transfers(self, now: float, limit: int) -> list[str]:
        due: list[str] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now and len(due) < limit:
            deadline, tid = heapq.heappop(heap)
            t = self._transfers.get(tid)
            if t is not None and t.deadline == deadline:
                due.append(tid)
        return due

    def _append(self, events: Sequence[Addressed]) -> None:
        for addressed in events:
            self._logs.append(addressed.engine_id, addressed.event)

    async def append_events(self, events: Sequence[Addressed]) -> None:
        self._revision += 1
        self._append(events)

    async def read_events(self, engine_id: str, start_sequence: int, limit: int) -> EventPage:
        log = self._logs.get(engine_id)
        if log is None:
            return EventPage((), 0, forgotten=True)
        first = log.last_sequence - len(log.events) + 1
        if start_sequence < first:
            return EventPage((), log.last_sequence, resync_sequence=log.last_sequence + 1)
        offset = start_sequence - first
        kept = log.events
        events = [evolve(kept[i], sequence=first + i) for i in range(offset, min(len(kept), offset + limit))]
        return EventPage(events, log.last_sequence)

    async def wait_events(self, engine_id: str, after_sequence: int, timeout: float) -> None:
        log = self._logs.get(engine_id)
        if log is None:
            await asyncio.sleep(timeout)
            return
        if log.last_sequence > after_sequence:
            await asyncio.sleep(0)  # always yield, so a caller looping on this never starves the event loop
            return
        try:
            await asyncio.wait_for(log.changed().wait(), timeout)
        except TimeoutError:
            return

    async def last_event_sequence(self, engine_id: str) -> int:
        log = self._logs.get(engine_id)
        return log.last_sequence if log else 0

    async def event_log_bytes(self, engine_id: str) -> int:
        log = self._logs.get(engine_id)
        return log.bytes if log else 0

    async def get_response(self, key: str) -> bytes | None:
        return self._answers.get(key, self._clock())

    async def put_response(self, key: str, value: bytes, ttl: float, owner: str = "") -> None:
        self._answers.put(key, value, self._clock(), ttl, owner)

    async def answer_bytes(self, owner: str) -> tuple[int, int]:
        return self._answers.bytes, self._answers.owner_bytes(owner)

    async def page_token_key(self) -> bytes:
        return self._page_key

    async def counts(self) -> StoreCounts:
        live = sum(1 for e in self._engines.values() if not e.ended_at)
        return StoreCounts(live, Counter(self._transfers[tid].state for tid in self._live_ids))

    def credits(self) -> CreditStore:
        """In-process reservations (rendezvous.store.credits.MemoryCredits), made on first use."""
        ledger: CreditStore | None = getattr(self, "_credits", None)
        if ledger is None:
            ledger = self._credits = MemoryCredits()
        return ledger

    def _alive(self, engine_id: str, now: float) -> bool:
        engine = self._engines.get(engine_id)
        return engine is not None and engine.alive(now)

    def index(self) -> IndexStore:
        """The in-process KV index (rendezvous.store.cache_index.MemoryIndex), made on first use."""
        kept: IndexStore | None = getattr(self, "_kv_index", None)
        if kept is None:
            kept = self._kv_index = MemoryIndex(self._alive)
        return kept


__all__ = ["MemoryStore"]
