"""The coordinator: runs the pure state machine (rendezvous.core) against a store.

It validates callers (engine, incarnation, lease), applies one transition per batch item,
turns lapsed leases and deadlines into transitions (the sweeper), and reports transitions to
an observer (metrics). It knows nothing of gRPC; the server maps the wire onto it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol, TypeVar

from rendezvous import sweeper
from rendezvous.cache_index import CacheIndex
from rendezvous.core import budget, paging
from rendezvous.core import engines as engine_rules
from rendezvous.core import transfers as lifecycle
from rendezvous.core.bindings import BindingRules
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import (
    LIVE_STATES,
    Addressed,
    Engine,
    Event,
    EventType,
    Role,
    State,
    Transfer,
    positional,
)
from rendezvous.core.rules import Binding, CallerT, Chain, Decision, SpecT
from rendezvous.core.transfers import Context, Transition
from rendezvous.core.validation import check_batch, check_id
from rendezvous.credit_ledger import CreditLedger, CreditOutcome
from rendezvous.pacing import Pacer, paced_cut
from rendezvous.protocol.errors import Reason, RendezvousError, transfer_not_found
from rendezvous.protocol.pages import EnginePage, TransferPage
from rendezvous.protocol.records import EngineCredits
from rendezvous.protocol.requests import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    CreditSpec,
    EngineSpec,
    ReleaseSpec,
    RevocationAck,
    SourceReadySpec,
    TargetSpec,
)
from rendezvous.store.base import CallerView, EventPage, Store, StoreCounts

log = logging.getLogger(__name__)

_BINDING_REFUSALS = frozenset({Reason.BINDING_INVALID, Reason.BINDING_MISMATCH, Reason.BINDING_REQUIRED})

A = TypeVar("A")
B = TypeVar("B")


class TransitionObserver(Protocol):
    """Told about every applied transition (for metrics); must not raise or block."""

    def on_transition(self, before: Transfer | None, after: Transfer | None, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class ItemOutcome:
    """The result of one batch item: the transfer after it, or the error that rejected it."""

    transfer_id: str
    transfer: Transfer | None = None
    error: RendezvousError | None = None


# A batch item's values, built without the frozen __init__'s cost (rendezvous.core.model.positional).
_outcome = positional(ItemOutcome)
_context = positional(Context)


_STORE_BATCH = 256
"""Transfers a sweep or an engine loss applies per store call (Store.update_transfers)."""


class Coordinator:
    """The rendezvous's behaviour, independent of transport."""

    def __init__(
        self,
        store: Store,
        limits: Limits | None = None,
        timeouts: Timeouts | None = None,
        clock: Callable[[], float] = time.time,
        observer: TransitionObserver | None = None,
        bindings: BindingRules | None = None,
    ) -> None:
        self.store = store
        self.bindings = bindings
        self.limits = limits or Limits()
        self.timeouts = timeouts or Timeouts()
        self.clock = clock
        self.observer = observer
        self.credits = CreditLedger(store, self.limits, self.timeouts, clock)
        self.index = CacheIndex(store, self.limits, clock)
        self._page_key: bytes | None = None

    async def _both(self, first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
        """Two store reads: in flight together where that saves a round trip (Store.concurrent), else in turn
        (never suspending on a store that answers at once)."""
        if self.store.concurrent:
            return await asyncio.gather(first, second)
        try:
            value = await first
        except BaseException:
            if inspect.iscoroutine(second):
                second.close()  # never started: nothing to wait for, and no "never awaited" warning
            raise
        return value, await second

    async def _page_token_key(self) -> bytes:
        """The deployment's page-token key (Store.page_token_key), read once (it never changes), when a listing
        first needs it (one page with no token needs none)."""
        if self._page_key is None:
            self._page_key = await self.store.page_token_key()
        return self._page_key

    def context(self) -> Context:
        """The context a transition of now runs in (the clock read once, the policy)."""
        return _context(self.clock(), self.limits, self.timeouts)

    async def _apply(
        self, transfer_id: str, fn: Callable[[Transfer | None, Mapping[str, Engine]], Decision]
    ) -> Decision:
        decision = _decided(await self.store.update_transfer(transfer_id, fn))
        self._observe(transfer_id, decision)
        return decision

    async def _apply_all(
        self, updates: Sequence[tuple[str, Callable[[Transfer | None, Mapping[str, Engine]], Decision]]]
    ) -> list[Decision | Exception]:
        """_apply for several transfers in one store call (Store.update_transfers): a decision or an error each."""
        results = await self.store.update_transfers(updates)
        decisions: list[Decision | Exception] = []
        for (transfer_id, _), result in zip(updates, results, strict=True):
            if isinstance(result, Exception):
                decisions.append(result)
            else:
                decision = _decided(result)
                self._observe(transfer_id, decision)
                decisions.append(decision)
        return decisions

    def _observe(self, transfer_id: str, decision: Decision) -> None:
        """Tell the observer and the log about an applied transition."""
        before = decision.before
        after = decision.transfer
        if before is not after:
            if self.observer is not None:
                self.observer.on_transition(before, after, self.clock())
            _log_transition(transfer_id, before, after)

    # Engines

    async def register_engine(self, spec: EngineSpec) -> tuple[Engine, int]:
        """Register a new incarnation; returns it and the sequence its watch should start from."""
        now = self.clock()
        # Every event of the new incarnation comes after this: the record keeps it for the engine's other ranks.
        # The memory budget (core: budget.check_engine) is checked against the usage of the server and of the
        # registering identity as it is now; both reads in one round trip to a networked store.
        last, tally = await self._both(self.store.last_event_sequence(spec.engine_id), self.store.usage(spec.owner))
        first = last + 1

        def registered(cur: Engine | None) -> Engine:
            new = engine_rules.register_engine(now, cur, spec, self.limits, self.timeouts, first)
            budget.check_engine(self.limits, tally, cur, new)
            return new

        # The record names the incarnation it replaced (read inside the atomic update), so concurrent
        # re-registrations each end their predecessor, and a loss this call cannot finish (cancelled,
        # store down, replica killed) is applied by the next keep-alive or sweep.
        engine = await self.store.update_engine(spec.engine_id, registered)
        assert engine is not None
        engine = await self._apply_pending_loss(engine, now)
        log.info(
            "engine registered",
            extra={
                "engine_id": engine.engine_id,
                "pool": engine.pool,
                "role": engine.role.name,
                "incarnation": engine.incarnation,
            },
        )
        return engine, await self.store.last_event_sequence(spec.engine_id) + 1

    async def keep_alive(self, engine_id: str, incarnation: int) -> Engine:
        """Renew an engine's lease: the incarnation that holds it must be named (0, which skips the check on other
        calls, would let a process that lost track of its incarnation keep a successor's lease alive after the
        successor died, and its transfers with it)."""
        if not incarnation:
            raise RendezvousError(
                Reason.STALE_INCARNATION,
                f"KeepAlive of engine {engine_id} names no incarnation; renew the one RegisterEngine returned",
                engine_id=engine_id,
                field="incarnation",
            )
        now = self.clock()
        engine = await self.store.update_engine(
            engine_id,
            lambda cur: engine_rules.renew_lease(now, engine_rules.check_incarnation(now, cur, engine_id, incarnation)),
        )
        assert engine is not None
        return await self._apply_pending_loss(engine, now)

    async def _apply_pending_loss(self, engine: Engine, now: float) -> Engine:
        """Abort what the incarnation engine replaced (and any before it) still holds, then clear the mark."""
        if not engine.unlost_incarnation:
            return engine
        pending = engine.unlost_incarnation
        await self.lose_engine(engine_rules.predecessor(engine, now))
        cleared = await self.store.update_engine(engine.engine_id, lambda cur: engine_rules.loss_applied(cur, pending))
        return cleared if cleared is not None and cleared.incarnation == engine.incarnation else engine

    async def deregister_engine(self, engine_id: str, incarnation: int) -> int:
        """End an engine's incarnation now; returns how many live transfers were aborted."""
        now = self.clock()
        ended = await self.store.update_engine(
            engine_id,
            lambda cur: engine_rules.end_incarnation(
                now, engine_rules.check_incarnation(now, cur, engine_id, incarnation)
            ),
        )
        assert ended is not None
        log.info("engine deregistered", extra={"engine_id": engine_id, "incarnation": ended.incarnation})
        return await self.lose_engine(ended)

    async def get_engine(self, engine_id: str) -> Engine:
        """A live engine."""
        check_id("engine_id", engine_id, self.limits)
        engine = await self.store.get_engine(engine_id)
        if engine is None or not engine.alive(self.clock()):
            raise RendezvousError(Reason.ENGINE_NOT_FOUND, f"engine {engine_id} is not registered", engine_id=engine_id)
        return engine

    async def list_engines(
        self,
        pool: str = "",
        role: Role | None = None,
        page_size: int = 0,
        page_token: str = "",
        weigh: Callable[[Engine], int] = paging.weightless,
    ) -> EnginePage[Engine]:
        """Live engines sorted by id, optionally of one pool and role, paged.

        A page also ends before it outgrows max_response_bytes by weigh (an engine's size in the
        response); it holds one engine at least.
        """
        limits = self.limits
        size = paging.page_size(page_size, limits.default_engine_page, limits.max_engine_page)
        scope = f"engines {pool} {role.name if role else ''}"
        after = paging.decode_token(await self._page_token_key(), scope, page_token) if page_token else ""
        now = self.clock()

        def wanted(e: Engine) -> bool:
            return e.alive(now) and (not pool or e.pool == pool) and (role is None or e.role == role)

        # One more than a page tells whether another follows.
        found = await self.store.page_engines(after, size + 1, wanted)
        page = await paced_cut(found, size, weigh, limits.max_response_bytes)
        more = len(found) > len(page)
        token = paging.encode_token(await self._page_token_key(), scope, page[-1].engine_id) if more else ""
        return EnginePage(page, token)

    async def apply_each(
        self, transfer_ids: Sequence[str], transition: Callable[[Transfer | None], Transition], failure: str
    ) -> list[Transition]:
        """A transition no caller asked for (an engine loss, an expiry) on each transfer, _STORE_BATCH per store
        call; a transfer it fails on is logged under failure and left out (one bad record must not keep the
        others from the rule: its deadline still applies)."""
        applied: list[Transition] = []
        for first in range(0, len(transfer_ids), _STORE_BATCH):
            chunk = transfer_ids[first : first + _STORE_BATCH]
            results = await self._apply_all([(t, lambda cur, _e: Decision.of(transition(cur), cur)) for t in chunk])
            for transfer_id, result in zip(chunk, results, strict=True):
                if isinstance(result, Exception):
                    log.error(failure, exc_info=result, extra={"transfer_id": transfer_id})
                else:
                    applied.append(result)
        return applied

    async def lose_engine(self, lost: Engine) -> int:
        """Abort the live transfers of an ended incarnation and tell its peers; its credits come back and its KV
        index entry goes."""
        ctx = self.context()
        await self.credits.reclaim(lost)
        await self.index.drop(lost)
        aborted = 0
        peers: set[str] = set()
        ids = await self.store.live_transfer_ids(lost.engine_id)
        lost_by = partial(lifecycle.engine_lost, ctx, lost=lost)
        for result in await self.apply_each(ids, lost_by, "cannot apply engine loss"):
            t = result.transfer
            if t is not None and t.state == State.ABORTED and t.times.end_time == ctx.now:
                aborted += 1
            peers.update(a.engine_id for a in result.events)
        if peers:
            note: Event[Transfer, Engine] = Event(EventType.PEER_LOST, ctx.now, peer=lost)
            await self.store.append_events([Addressed(p, note) for p in sorted(peers)])
        if aborted:
            log.warning("engine lost", extra={"engine_id": lost.engine_id, "aborted_transfers": aborted})
        return aborted

    # Transfers

    async def _caller(
        self, engine_id: str, incarnation: int, joins: bool = False, blocks: bool = False
    ) -> tuple[Engine, CallerView]:
        """The calling incarnation, checked, and what its batch's limits need (joins: its live-transfer count;
        blocks: the budget's tallies), read with its record (one round trip to a networked store)."""
        check_id("engine_id", engine_id, self.limits)
        view = await self.store.caller(engine_id, live=joins, usage=blocks)
        return engine_rules.check_incarnation(self.clock(), view.engine, engine_id, incarnation), view

    async def _batch(
        self,
        chain: Chain[CallerT, SpecT],
        items: Sequence[SpecT],
        view: CallerView | None = None,
    ) -> list[ItemOutcome]:
        """Every item through the chain (core: rules); an item's error does not stop the others.

        With the caller's live-transfer count in view (_caller with joins), its live-transfer limit applies
        (core: engines.LiveTransferLimit); with the budget's tallies (with blocks: items that name block
        ids), the live-block budget (core: budget.BlockBudget). Items apply one after another, each with the
        chain its predecessors left (Chain.after), unless none can reach a limit.
        """
        check_batch(len(items), self.limits)
        caller = chain.caller
        if caller is not None and view is not None:
            if view.live_transfers is not None:
                chain = replace(
                    chain, limit=engine_rules.LiveTransferLimit.of(self.limits, caller, view.live_transfers)
                )
            if view.tally is not None:
                chain = replace(chain, budget=budget.BlockBudget.of(self.limits, caller, view.tally))
        caller_id = caller.engine_id if caller is not None else ""

        def refused(item: SpecT, err: Exception) -> ItemOutcome:
            if not isinstance(err, RendezvousError):
                raise err
            if err.reason in _BINDING_REFUSALS:
                log.info(
                    "transfer half refused",
                    extra={"transfer_id": item.transfer_id, "engine_id": caller_id, "reason": err.reason},
                )
            return ItemOutcome(item.transfer_id, error=err)

        most = sum(len(getattr(item, "block_ids", ())) for item in items) if chain.budget is not None else 0
        if self.store.concurrent and chain.within(len(items), most):
            # No item can reach a limit, so they may be applied together (one store call, one round trip
            # to a networked store); items of one transfer still apply in order.
            free = chain.unlimited()
            results = await self._apply_all([(i.transfer_id, partial(free.decide, self.context(), i)) for i in items])
            return [
                refused(item, r) if isinstance(r, Exception) else _outcome(item.transfer_id, r.transfer, None)
                for item, r in zip(items, results, strict=True)
            ]
        outcomes: list[ItemOutcome] = []
        pacer = Pacer()  # a store that never waits (memory) would otherwise hold the event loop for the batch
        for item in items:
            await pacer.tick()
            decision: Decision | None = None
            try:
                decision = await self._apply(item.transfer_id, partial(chain.decide, self.context(), item))
            except RendezvousError as err:
                outcomes.append(refused(item, err))
            else:
                outcomes.append(_outcome(item.transfer_id, decision.transfer, None))
            chain = chain.after(decision)
        return outcomes

    def _binding(self, caller: Engine, half: Role | None, exempt: bool) -> Binding | None:
        """The binding step for caller taking half of its transfers (None: an abort), unless the server has no
        binding keys; exempt callers (admin) need none."""
        return Binding(self.bindings, caller.engine_id, half, exempt) if self.bindings is not None else None

    async def register_targets(
        self, engine_id: str, incarnation: int, specs: Sequence[TargetSpec], exempt: bool = False
    ) -> list[ItemOutcome]:
        """A consumer registers destination blocks (exempt: needs no binding, see `_binding`)."""
        check_batch(len(specs), self.limits)
        # The items' reservations on any consumer are read with the caller (one round trip to a networked store).
        (consumer, view), held = await self._both(
            self._caller(engine_id, incarnation, joins=True, blocks=True),
            self.credits.holders([s.transfer_id for s in specs]),
        )
        capacity = await self.credits.capacity(consumer, held, specs)
        binding = self._binding(consumer, Role.CONSUMER, exempt)
        chain = Chain(lifecycle.register_target, consumer, binding=binding, capacity=capacity)
        outcomes = await self._batch(chain, specs, view)
        # A reservation the target took the place of is spent: drop it (the core no longer counts it anyway).
        # Consumers without a capacity pay nothing here (routers reserve only on those with one).
        for o in outcomes:
            if o.error is None and o.transfer_id in capacity.reservations:
                await self.store.credits().drop(o.transfer_id)
        return outcomes

    async def claim_transfers(
        self, engine_id: str, incarnation: int, specs: Sequence[ClaimSpec], exempt: bool = False
    ) -> list[ItemOutcome]:
        """A producer claims transfers (exempt: needs no binding, see `_binding`)."""
        producer, view = await self._caller(engine_id, incarnation, joins=True)
        chain = Chain(lifecycle.claim, producer, binding=self._binding(producer, Role.PRODUCER, exempt))
        return await self._batch(chain, specs, view)

    async def mark_sources_ready(
        self, engine_id: str, incarnation: int, specs: Sequence[SourceReadySpec], exempt: bool = False
    ) -> list[ItemOutcome]:
        """A producer's source blocks are computed; claims the transfer if it had not (exempt: needs no
        binding, see `_binding`)."""
        producer, view = await self._caller(engine_id, incarnation, joins=True, blocks=True)
        chain = Chain(lifecycle.mark_source_ready, producer, binding=self._binding(producer, Role.PRODUCER, exempt))
        return await self._batch(chain, specs, view)

    async def complete_transfers(
        self, engine_id: str, incarnation: int, specs: Sequence[CompletionSpec]
    ) -> list[ItemOutcome]:
        """The side that moved the bytes reports outcomes."""
        mover, _ = await self._caller(engine_id, incarnation)
        return await self._batch(Chain(lifecycle.complete, mover), specs)

    async def acknowledge_revocations(
        self, engine_id: str, incarnation: int, specs: Sequence[RevocationAck]
    ) -> list[ItemOutcome]:
        """A producer confirms it will not write revoked generations."""
        producer, _ = await self._caller(engine_id, incarnation)
        return await self._batch(Chain(lifecycle.acknowledge_revocation, producer), specs)

    async def release_targets(
        self, engine_id: str, incarnation: int, specs: Sequence[ReleaseSpec]
    ) -> list[ItemOutcome]:
        """A consumer is done with committed transfers."""
        consumer, _ = await self._caller(engine_id, incarnation)
        return await self._batch(Chain(lifecycle.release, consumer), specs)

    async def abort_transfers(
        self, engine_id: str, incarnation: int, specs: Sequence[AbortSpec], exempt: bool = False
    ) -> list[ItemOutcome]:
        """An engine, or with an empty engine_id a router or operator, aborts transfers (under required bindings,
        an engine only those it takes part in, unless exempt: core.bindings.check_abort)."""
        caller = (await self._caller(engine_id, incarnation))[0] if engine_id else None
        binding = self._binding(caller, None, exempt) if caller is not None else None
        outcomes = await self._batch(Chain(lifecycle.abort, caller, binding=binding), specs)
        # An ended transfer's reservation holds no credit (core: credits.counts), whoever aborted it; a router's
        # abort, which may name an id that only holds a reservation, also drops the record (engines' aborts, on
        # the hot path, leave it to the router's release or the sweeper).
        if caller is None:
            for o in outcomes:
                if o.error is None or o.error.reason == Reason.TRANSFER_NOT_FOUND:
                    await self.store.credits().drop(o.transfer_id)
        return outcomes

    # Credits (rendezvous.credit_ledger)

    async def engine_tallies(self, engines: Sequence[Engine]) -> tuple[dict[str, int], dict[str, EngineCredits]]:
        """Each engine's live transfers, and what each consumer with a capacity has in use and reserved
        (ListEngines, GetEngine): the reads in flight together where the store allows."""
        ids = [e.engine_id for e in engines]
        return await self._both(self.store.live_transfer_counts(ids), self.credits.usage_of(engines))

    async def reserve_credits(self, specs: Sequence[CreditSpec], ttl: float = 0.0) -> list[CreditOutcome]:
        """Reserve credit on consumer engines for transfer ids (CreditLedger.reserve)."""
        return await self.credits.reserve(specs, ttl)

    async def release_credits(self, transfer_ids: Sequence[str]) -> list[CreditOutcome]:
        """Drop the reservations of transfer ids (CreditLedger.release)."""
        return await self.credits.release(transfer_ids)

    async def get_transfer(self, transfer_id: str) -> Transfer:
        """A transfer, live or tombstone."""
        check_id("transfer_id", transfer_id, self.limits)
        t = await self.store.get_transfer(transfer_id)
        if t is None:
            raise transfer_not_found(transfer_id)
        return t

    async def list_transfers(
        self,
        engine_id: str = "",
        states: Iterable[State] = (),
        page_size: int = 0,
        page_token: str = "",
        weigh: Callable[[Transfer], int] = paging.weightless,
    ) -> TransferPage[Transfer]:
        """Transfers sorted by id, paged; by default the live ones. A page ends before it outgrows
        max_response_bytes by weigh, as in list_engines."""
        if engine_id:
            check_id("engine_id", engine_id, self.limits)
        wanted = frozenset(states) or frozenset(LIVE_STATES)
        size = paging.page_size(page_size, self.limits.max_list_page, self.limits.max_list_page)
        scope = f"transfers {engine_id} {','.join(sorted(s.name for s in wanted))}"
        after = paging.decode_token(await self._page_token_key(), scope, page_token) if page_token else ""
        # One more than a page tells whether another follows; the store reads about a page, not everything.
        found = await self.store.page_transfers(engine_id or None, wanted, after, size + 1)
        page = await paced_cut(found, size, weigh, self.limits.max_response_bytes)
        more = len(found) > len(page)
        token = paging.encode_token(await self._page_token_key(), scope, page[-1].transfer_id) if more else ""
        return TransferPage(page, token)

    # Events

    async def check_watch(self, engine_id: str, start_sequence: int) -> int:
        """Validate a Watch request; returns the first sequence to send."""
        check_id("engine_id", engine_id, self.limits)
        if await self.store.get_engine(engine_id) is None:
            raise RendezvousError(Reason.ENGINE_NOT_FOUND, f"engine {engine_id} is not registered", engine_id=engine_id)
        last = await self.store.last_event_sequence(engine_id)
        if start_sequence > last + 1:
            raise RendezvousError(
                Reason.SEQUENCE_INVALID,
                f"start_sequence {start_sequence} is ahead of the engine's latest sequence {last}",
                last_sequence=last,
            )
        return start_sequence or last + 1

    async def read_events(self, engine_id: str, start_sequence: int, limit: int) -> EventPage:
        """Events of an engine from start_sequence on."""
        return await self.store.read_events(engine_id, start_sequence, limit)

    async def wait_events(self, engine_id: str, after_sequence: int, timeout: float) -> None:
        """Wait until the engine's log passes after_sequence (or timeout)."""
        await self.store.wait_events(engine_id, after_sequence, timeout)

    async def counts(self) -> StoreCounts:
        """Live engines and transfers by state."""
        return await self.store.counts()

    # Time (rendezvous.sweeper)

    async def sweep(self, max_transfers: int = 10_000) -> None:
        """End lapsed leases, expire due transfers and drop old engine tombstones and reservations."""
        await sweeper.sweep(self, max_transfers)


def _log_transition(transfer_id: str, before: Transfer | None, after: Transfer | None) -> None:
    """Aborts at info, every state change at debug; structured fields carry the transfer id."""
    aborted = (
        after is not None and after.state is State.ABORTED and (before is None or before.state is not State.ABORTED)
    )
    if not aborted and not log.isEnabledFor(logging.DEBUG):
        return  # the common case: nothing to log, so no names to look up
    old_state = before.state.name if before else "NONE"
    new_state = after.state.name if after else "FORGOTTEN"
    if aborted:
        assert after is not None
        log.info(
            "transfer aborted",
            extra={
                "transfer_id": transfer_id,
                "from_state": old_state,
                "abort_reason": after.abort_reason.name,
                "abort_message": after.abort_message,
                "generation": after.generation,
            },
        )
    elif old_state != new_state:
        log.debug(
            "transfer state",
            extra={
                "transfer_id": transfer_id,
                "from_state": old_state,
                "to_state": new_state,
                "generation": after.generation if after else 0,
            },
        )


def _decided(transition: Transition) -> Decision:
    """The decision a store applied: it answers with what the applied function returned."""
    assert isinstance(transition, Decision), transition
    return transition
