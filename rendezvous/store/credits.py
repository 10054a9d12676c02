"""Where credit reservations live (rendezvous.core.credits decides what they mean).

Each consumer engine has a ledger: its reservations and a version that every change to them bumps. A
reservation is written with compare-and-set on that version (and on who holds the transfer id's reservation
now), so two routers, or two replicas, that both computed "it fits" on the same ledger cannot both write:
the second one reads again and the core decides again. `MemoryCredits` serves the memory store; the Redis
store has the same contract in Lua (rendezvous/store/redis/credits.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from rendezvous.core.credits import Reservation


@dataclass(frozen=True)
class Ledger:
    """One engine's reservations as of `version` (0: never written)."""

    engine_id: str
    version: int
    reservations: tuple[Reservation, ...]


class CreditStore(ABC):
    """Reservations by transfer id, per consumer engine, with an expiry index."""

    @abstractmethod
    async def ledger(self, engine_id: str) -> Ledger:
        """An engine's reservations and their version."""

    @abstractmethod
    async def get(self, transfer_id: str) -> Reservation | None:
        """The reservation held for a transfer id (expired or not), or None."""

    @abstractmethod
    async def put(self, reservation: Reservation, version: int, holder: Reservation | None) -> bool:
        """Write reservation if its engine's ledger is still at version and the transfer id's reservation is
        still holder (None: none); holder, if on another engine, is dropped from that engine's ledger.
        False (nothing written) when either changed."""

    @abstractmethod
    async def drop(self, transfer_id: str, expected: Reservation | None = None) -> Reservation | None:
        """Drop a transfer id's reservation; returns it (None when there was none). With expected, only if the
        reservation is still that one (else None, nothing dropped): a drop decided on a reservation read earlier
        (expired, or on an ended incarnation) must not drop the one another replica has put in its place since."""

    @abstractmethod
    async def due(self, now: float, limit: int) -> list[str]:
        """Transfer ids whose reservation expired by now (at most limit)."""

    async def ledgers(self, engine_ids: Sequence[str]) -> dict[str, Ledger]:
        """The ledgers of several engines (backends may do it in one round trip)."""
        return {engine_id: await self.ledger(engine_id) for engine_id in engine_ids}

    async def holders(self, transfer_ids: Sequence[str]) -> dict[str, Reservation]:
        """The reservations (expired or not) held for those of transfer_ids that have one (backends may do it in
        one command)."""
        found = {transfer_id: await self.get(transfer_id) for transfer_id in transfer_ids}
        return {transfer_id: r for transfer_id, r in found.items() if r is not None}


class MemoryCredits(CreditStore):
    """Dicts; atomic because nothing awaits between a check and its write on the one event loop."""

    def __init__(self) -> None:
        self._by_transfer: dict[str, Reservation] = {}
        self._by_engine: dict[str, dict[str, Reservation]] = {}
        self._versions: dict[str, int] = {}

    async def ledger(self, engine_id: str) -> Ledger:
        held = self._by_engine.get(engine_id, {})
        return Ledger(engine_id, self._versions.get(engine_id, 0), tuple(held.values()))

    async def get(self, transfer_id: str) -> Reservation | None:
        return self._by_transfer.get(transfer_id)

    def _remove(self, reservation: Reservation) -> None:
        held = self._by_engine.get(reservation.engine_id)
        if held is not None and held.pop(reservation.transfer_id, None) is not None:
            self._versions[reservation.engine_id] = self._versions.get(reservation.engine_id, 0) + 1
            if not held:
                del self._by_engine[reservation.engine_id]

    async def put(self, reservation: Reservation, version: int, holder: Reservation | None) -> bool:
        engine_id = reservation.engine_id
        if self._versions.get(engine_id, 0) != version or self._by_transfer.get(reservation.transfer_id) != holder:
            return False
        if holder is not None:
            self._remove(holder)
        self._by_transfer[reservation.transfer_id] = reservation
        self._by_engine.setdefault(engine_id, {})[reservation.transfer_id] = reservation
        self._versions[engine_id] = self._versions.get(engine_id, 0) + 1
        return True

    async def drop(self, transfer_id: str, expected: Reservation | None = None) -> Reservation | None:
        reservation = self._by_transfer.get(transfer_id)
        if reservation is None or (expected is not None and reservation != expected):
            return None
        del self._by_transfer[transfer_id]
        self._remove(reservation)
        return reservation

    async def due(self, now: float, limit: int) -> list[str]:
        # A scan: reservations are few (at most the fleet's decode capacity) and short-lived.
        return [r.transfer_id for r in self._by_transfer.values() if r.expires_at <= now][:limit]
