"""The coordinator's credit side: reservations on consumers' ledgers, and what consumers have in use.

A router reserves decode admission credit on a consumer (ReserveCredits) before it sends a request there; a
RegisterTargets then takes the reservation's place (core: credits.target_admission, a step of rules.Chain).
`CreditLedger` reads and writes the store's ledgers (Store.credits) and asks rendezvous.core.credits to
decide; the coordinator owns one, and its sweeper drops lapsed reservations through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rendezvous.core import credits
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Engine, Transfer
from rendezvous.core.rules import Capacity
from rendezvous.core.validation import check_batch, check_id
from rendezvous.pacing import Pacer
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.protocol.records import EngineCredits
from rendezvous.protocol.requests import CreditSpec, TargetSpec
from rendezvous.store.base import Store

log = logging.getLogger(__name__)

T = TypeVar("T")

_RESERVE_ATTEMPTS = 32
"""Compare-and-set rounds of one reservation before it gives up (every round lost is another's success)."""


@dataclass(frozen=True)
class CreditOutcome:
    """The result of one ReserveCredits or ReleaseCredits item: the reservation, or the error."""

    transfer_id: str
    reservation: credits.Reservation | None = None
    error: RendezvousError | None = None


class CreditLedger:
    """Credit reservations and usage over a store's credit ledgers."""

    def __init__(
        self, store: Store, limits: Limits, timeouts: Timeouts, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.limits = limits
        self.timeouts = timeouts
        self.clock = clock

    async def _each(self, calls: Sequence[Awaitable[T]]) -> list[T]:
        """Store calls in flight together where that gains (Store.concurrent), else one by one."""
        if self.store.concurrent:
            return list(await asyncio.gather(*calls))
        return [await call for call in calls]

    async def _usage(
        self,
        engine: Engine,
        reservations: Sequence[credits.Reservation],
        now: float,
        records: dict[str, Transfer | None] | None = None,
    ) -> EngineCredits:
        """What engine has in use now (core: credits.usage), from its unsettled transfers (the live index: about
        as many as its capacity admits, so the reads are bounded by it; only counted, without a block limit) and
        its reservations' transfers: those not in `records` read and added to it (a batch's items then read each
        reserved transfer once; a record that changed meanwhile can only make a reservation count that no longer
        does, which errs on the side of refusing)."""
        records = {} if records is None else records
        unread = [r.transfer_id for r in reservations if r.transfer_id not in records]
        records.update(zip(unread, await self._each([self.store.get_transfer(tid) for tid in unread]), strict=True))
        if not engine.capacity.max_blocks:
            count = (await self.store.live_transfer_counts([engine.engine_id]))[engine.engine_id]
            return credits.usage_by_count(engine, count, reservations, records, now)
        live = await self.store.live_transfer_ids(engine.engine_id)
        targets = [t for t in await self._each([self.store.get_transfer(tid) for tid in live]) if t is not None]
        return credits.usage(engine, targets, reservations, records, now)

    async def holders(self, transfer_ids: Sequence[str]) -> dict[str, credits.Reservation]:
        """The credit reservations (on any consumer) of the well-formed ids among transfer_ids, in one store call:
        a RegisterTargets honours the router's choice of consumer (core: credits.check_reserved_elsewhere)."""
        ids = []
        for transfer_id in dict.fromkeys(transfer_ids):
            try:
                check_id("transfer_id", transfer_id, self.limits)
            except RendezvousError:
                continue  # its item is refused for it
            ids.append(transfer_id)
        return await self.store.credits().holders(ids)

    async def capacity(
        self, consumer: Engine, held: Mapping[str, credits.Reservation], specs: Sequence[TargetSpec]
    ) -> Capacity:
        """The capacity step of a RegisterTargets batch (core: rules.Capacity): held, the items' reservations on
        any consumer (`holders`); for a consumer with a capacity, its usage now and its reservations of the
        batch's ids."""
        if not consumer.capacity.limited:
            return Capacity(consumer, held, {}, None)
        ledger = await self.store.credits().ledger(consumer.engine_id)
        spent = await self._usage(consumer, ledger.reservations, self.clock())
        wanted = {s.transfer_id for s in specs}
        reservations = {r.transfer_id: r for r in ledger.reservations if r.transfer_id in wanted}
        return Capacity(consumer, held, reservations, spent)

    async def usage_of(self, engines: Sequence[Engine]) -> dict[str, EngineCredits]:
        """What each consumer with a capacity has in use and reserved (ListEngines, GetEngine)."""
        now = self.clock()
        limited = [e for e in engines if e.capacity.limited]
        ledgers = await self.store.credits().ledgers([e.engine_id for e in limited])
        found = await self._each([self._usage(e, ledgers[e.engine_id].reservations, now) for e in limited])
        return {e.engine_id: u for e, u in zip(limited, found, strict=True)}

    async def reserve(self, specs: Sequence[CreditSpec], ttl: float = 0.0) -> list[CreditOutcome]:
        """Reserve credit on consumer engines for transfer ids, each item atomically (compare-and-set on the
        engine's ledger; core: credits.reserve decides). An item's error does not stop the others."""
        check_batch(len(specs), self.limits)
        lifetime = credits.credit_ttl(ttl, self.timeouts)
        outcomes: list[CreditOutcome] = []
        records: dict[str, Transfer | None] = {}  # the reserved transfers' records, read once per batch
        pacer = Pacer()
        for spec in specs:
            try:
                check_id("transfer_id", spec.transfer_id, self.limits)
                check_id("engine_id", spec.engine_id, self.limits)
                reservation = await self._reserve(spec, lifetime, records)
                outcomes.append(CreditOutcome(spec.transfer_id, reservation=reservation))
            except RendezvousError as err:
                outcomes.append(CreditOutcome(spec.transfer_id, error=err))
            await pacer.tick()
        return outcomes

    async def _reserve(self, spec: CreditSpec, ttl: float, records: dict[str, Transfer | None]) -> credits.Reservation:
        ledger_store = self.store.credits()
        for _ in range(_RESERVE_ATTEMPTS):
            now = self.clock()
            engine = await self.store.get_engine(spec.engine_id)
            ledger = await ledger_store.ledger(spec.engine_id)
            existing = await ledger_store.get(spec.transfer_id)
            transfer = await self.store.get_transfer(spec.transfer_id)
            limited = engine is not None and engine.capacity.limited
            spent = None
            if engine is not None and limited:
                spent = await self._usage(engine, ledger.reservations, now, records)
            reservation = credits.reserve(
                now, engine, spec, existing, transfer, spent or EngineCredits(), ttl, self.limits, ledger.reservations
            )
            if await ledger_store.put(reservation, ledger.version, existing):
                log.debug(
                    "credit reserved",
                    extra={"transfer_id": spec.transfer_id, "engine_id": spec.engine_id, "blocks": spec.blocks},
                )
                return reservation
        raise RendezvousError(
            Reason.STORE_UNAVAILABLE,
            f"engine {spec.engine_id}'s credit ledger kept changing under {_RESERVE_ATTEMPTS} attempts; retry",
            engine_id=spec.engine_id,
        )

    async def release(self, transfer_ids: Sequence[str]) -> list[CreditOutcome]:
        """Drop the reservations of transfer ids; an id without one is OK (nothing to release)."""
        check_batch(len(transfer_ids), self.limits)
        outcomes: list[CreditOutcome] = []
        for transfer_id in transfer_ids:
            try:
                check_id("transfer_id", transfer_id, self.limits)
                dropped = await self.store.credits().drop(transfer_id)
                outcomes.append(CreditOutcome(transfer_id, reservation=dropped))
            except RendezvousError as err:
                outcomes.append(CreditOutcome(transfer_id, error=err))
        return outcomes

    async def reclaim(self, lost: Engine) -> None:
        """Drop the reservations on an ended incarnation (and older ones): its credit is back."""
        ledger_store = self.store.credits()
        ledger = await ledger_store.ledger(lost.engine_id)
        for r in ledger.reservations:
            if r.incarnation <= lost.incarnation:
                await ledger_store.drop(r.transfer_id, expected=r)

    async def expire(self, now: float, limit: int) -> None:
        """Drop reservations past their ttl (the core no longer counts them; this frees their records)."""
        ledger_store = self.store.credits()
        for transfer_id in await ledger_store.due(now, limit):
            reservation = await ledger_store.get(transfer_id)
            if reservation is not None and reservation.expires_at <= now:
                # Only the one read: another replica may have reserved the id afresh since.
                await ledger_store.drop(transfer_id, expected=reservation)
