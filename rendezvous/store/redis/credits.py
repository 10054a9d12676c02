"""Credit reservations in Redis: the `CreditStore` contract (rendezvous/store/credits.py) in Lua scripts.

Keys (docs/operations.md): `cr:<engine>` (the engine's reservations), `crv:<engine>` (its ledger version),
`crt` (transfer id -> reservation), `crd` (expiry index). `put_credit` is the compare-and-set on the
ledger's version that makes ReserveCredits atomic across routers and replicas; every write carries the
epoch guard like the store's own scripts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from rendezvous.core.credits import Reservation
from rendezvous.store.codec import future_format
from rendezvous.store.credits import CreditStore, Ledger
from rendezvous.store.redis.guarded import GuardedScripts

"""Epoch refusals a write retries after acting on them."""


def encode(r: Reservation) -> str:
    """A reservation as JSON text (deterministic: compared byte for byte by put_credit)."""
    return json.dumps([r.transfer_id, r.engine_id, r.incarnation, r.blocks, r.expires_at], separators=(",", ":"))


def decode(data: bytes | str) -> Reservation:
    """The reservation of encode's text. Its format (1) is its shape: a later one starts with its number and is
    refused (FutureFormatError), never misread."""
    f = json.loads(data)
    if type(f[0]) is int:
        raise future_format("credit reservation", f[0])
    return Reservation(str(f[0]), str(f[1]), int(f[2]), int(f[3]), float(f[4]))


class RedisCredits(GuardedScripts, CreditStore):
    """Reservations of one Redis namespace, run through the store's scripts, epoch and command pipeline."""

    async def ledger(self, engine_id: str) -> Ledger:
        version, records = await self._scripts.run("read_credits", engine_id=engine_id)
        return Ledger(engine_id, int(version), tuple(decode(r) for r in records))

    async def ledgers(self, engine_ids: Sequence[str]) -> dict[str, Ledger]:
        # In flight together: the store's pipeliner sends them in one pipeline.
        found = await asyncio.gather(*(self.ledger(engine_id) for engine_id in engine_ids))
        return dict(zip(engine_ids, found, strict=True))

    async def get(self, transfer_id: str) -> Reservation | None:
        record = await self._command("HGET", self._prefix + "crt", transfer_id)
        return decode(record) if record else None

    async def holders(self, transfer_ids: Sequence[str]) -> dict[str, Reservation]:
        if not transfer_ids:
            return {}
        records = await self._command("HMGET", self._prefix + "crt", *transfer_ids)
        return {t: decode(r) for t, r in zip(transfer_ids, records, strict=True) if r}

    async def put(self, reservation: Reservation, version: int, holder: Reservation | None) -> bool:
        reply = await self._write(
            "put_credit",
            engine_id=reservation.engine_id,
            version=version,
            transfer_id=reservation.transfer_id,
            record=encode(reservation),
            holder=encode(holder) if holder is not None else "",
            holder_engine=holder.engine_id if holder is not None else "",
            expires_at=reservation.expires_at,
        )
        return bool(reply[0] == b"OK")

    async def drop(self, transfer_id: str, expected: Reservation | None = None) -> Reservation | None:
        reply = await self._write(
            "drop_credit", transfer_id=transfer_id, expected=encode(expected) if expected is not None else ""
        )
        return decode(reply[1]) if reply[0] == b"OK" else None

    async def due(self, now: float, limit: int) -> list[str]:
        if limit <= 0:
            return []
        ids = await self._command("ZRANGEBYSCORE", self._prefix + "crd", "-inf", now, "LIMIT", 0, limit)
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
