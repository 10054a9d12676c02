"""Decode admission credits: what a consumer engine's declared capacity admits, in one place.

A consumer declares an `EngineCapacity` when it registers (0 = no limit). What it has in use is known from
the service's own records: its live targets (unsettled transfers it is the consumer of, with their target
blocks) and the unspent reservations routers made on it (`ReserveCredits`). A reservation is spent once the
transfer it names has a consumer (the target replaces it: it is never counted twice), void once that
transfer ended, at its expiry, and with the incarnation it was made on (a crashed engine's credits come back
when its lease ends). These functions decide; stores persist reservations; the coordinator orchestrates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Engine, Role, Transfer
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.protocol.records import EngineCapacity, EngineCredits
from rendezvous.protocol.requests import CreditSpec

__all__ = [
    "CreditSpec",
    "EngineCapacity",
    "Reservation",
    "check_capacity",
    "counts",
    "credit_ttl",
    "reserve",
    "target_admission",
    "usage",
    "usage_by_count",
]


@dataclass(frozen=True)
class Reservation:
    """Credit held on a consumer incarnation for one transfer id until `expires_at`."""

    transfer_id: str
    engine_id: str
    incarnation: int
    blocks: int
    expires_at: float


def check_capacity(role: Role, capacity: EngineCapacity, limits: Limits) -> None:
    """A declared capacity at registration: within the server's maxima, and only for consumers."""
    for name, value, most in (
        ("max_transfers", capacity.max_transfers, limits.max_capacity_transfers),
        ("max_blocks", capacity.max_blocks, limits.max_capacity_blocks),
    ):
        if value < 0 or value > most:
            raise RendezvousError(
                Reason.CAPACITY_INVALID, f"capacity {name} {value} is not within 0..{most}", field=name, max=most
            )
    if capacity.limited and role != Role.CONSUMER:
        raise RendezvousError(
            Reason.CAPACITY_INVALID, "only a consumer engine declares a capacity", field="capacity", role=role.name
        )


def counts(reservation: Reservation, engine: Engine, transfer: Transfer | None, now: float) -> bool:
    """Whether a reservation still holds credit on engine: same incarnation, unexpired, and its transfer
    has neither a consumer yet (then the target holds the credit) nor ended."""
    if reservation.engine_id != engine.engine_id or reservation.incarnation != engine.incarnation:
        return False
    if reservation.expires_at <= now:
        return False
    return transfer is None or (not transfer.consumer_engine_id and not transfer.state.terminal)


def usage(
    engine: Engine,
    targets: Iterable[Transfer],
    reservations: Iterable[Reservation],
    transfers: Mapping[str, Transfer | None],
    now: float,
) -> EngineCredits:
    """What engine has in use: its unsettled targets (`targets` may hold other transfers: they are skipped),
    and the reservations that still count (`transfers`: the records of the reserved transfer ids)."""
    live = [
        t
        for t in targets
        if t.consumer_engine_id == engine.engine_id and t.consumer_incarnation == engine.incarnation and t.unsettled
    ]
    held = [r for r in reservations if counts(r, engine, transfers.get(r.transfer_id), now)]
    return EngineCredits(len(live), sum(len(t.target_block_ids) for t in live), len(held), sum(r.blocks for r in held))


def usage_by_count(
    engine: Engine,
    live_transfers: int,
    reservations: Iterable[Reservation],
    transfers: Mapping[str, Transfer | None],
    now: float,
) -> EngineCredits:
    """`usage` for an engine without a block limit, from the size of its live index alone (no target records
    read): every unsettled transfer of the engine id counts, an older incarnation's still pinned ones included,
    which errs on the side of refusing. Blocks in use are not counted (nothing limits them)."""
    held = [r for r in reservations if counts(r, engine, transfers.get(r.transfer_id), now)]
    return EngineCredits(live_transfers, 0, len(held), sum(r.blocks for r in held))


def _refuse(engine: Engine, limit: str, most: int, spent: EngineCredits, requested: int) -> RendezvousError:
    in_use = spent.transfers_in_use if limit == "transfers" else spent.blocks_in_use
    reserved = spent.transfers_reserved if limit == "transfers" else spent.blocks_reserved
    return RendezvousError(
        Reason.ENGINE_CAPACITY_EXCEEDED,
        f"engine {engine.engine_id} admits {most} {limit} at once: {in_use} in use, {reserved} reserved, "
        f"{requested} more asked",
        engine_id=engine.engine_id,
        limit=limit,
        max=most,
        in_use=in_use,
        reserved=reserved,
        requested=requested,
    )


def _fit(engine: Engine, spent: EngineCredits, transfers: int, blocks: int) -> None:
    capacity = engine.capacity
    if capacity.max_transfers and spent.transfers + transfers > capacity.max_transfers:
        raise _refuse(engine, "transfers", capacity.max_transfers, spent, transfers)
    if capacity.max_blocks and spent.blocks + blocks > capacity.max_blocks:
        raise _refuse(engine, "blocks", capacity.max_blocks, spent, blocks)


def credit_ttl(requested: float, timeouts: Timeouts) -> float:
    """The lifetime of a reservation: the requested one (0 = the default), at most max_timeout."""
    if requested < 0 or requested > timeouts.max_timeout:
        raise RendezvousError(
            Reason.TIMEOUT_INVALID, f"credit ttl {requested:g} s is not within 0..{timeouts.max_timeout:g}"
        )
    return requested or timeouts.default_credit_ttl


def reserve(
    now: float,
    engine: Engine | None,
    request: CreditSpec,
    existing: Reservation | None,
    existing_transfer: Transfer | None,
    spent: EngineCredits,
    ttl: float,
    limits: Limits,
    ledger: Sequence[Reservation] = (),
) -> Reservation:
    """The reservation for request, or why not.

    `existing` is the reservation already held for the transfer id (on any engine), `existing_transfer` the
    transfer's record, `spent` the engine's usage (which counts `existing` if it holds credit there), `ledger`
    the engine's reservations (at most `limits.max_credits_per_engine` unexpired ones, this id's aside). The
    same reservation again (same engine, same blocks) is idempotent: it is kept, with its expiry renewed.
    Another one for a transfer id that holds credit is CREDIT_CONFLICT; one for a transfer that already has
    a consumer or ended is TRANSFER_ENDED / TARGET_CONFLICT (nothing left to reserve for).
    """
    if engine is None or not engine.alive(now):
        raise RendezvousError(
            Reason.ENGINE_NOT_FOUND, f"engine {request.engine_id} is not registered", engine_id=request.engine_id
        )
    if engine.role != Role.CONSUMER:
        raise RendezvousError(
            Reason.WRONG_ROLE, f"engine {engine.engine_id} is a {engine.role.name.lower()}, not a consumer"
        )
    if request.blocks < 0 or request.blocks > limits.max_blocks_per_target:
        raise RendezvousError(
            Reason.TOO_MANY_BLOCKS,
            f"{request.blocks} blocks is not within 0..{limits.max_blocks_per_target}",
            max=limits.max_blocks_per_target,
        )
    t = existing_transfer
    if t is not None and t.state.terminal:
        raise RendezvousError(
            Reason.TRANSFER_ENDED, f"transfer {request.transfer_id} ended; mint a new id", transfer_id=t.transfer_id
        )
    if t is not None and t.consumer_engine_id:
        raise RendezvousError(
            Reason.TARGET_CONFLICT,
            f"transfer {request.transfer_id} already has its target on {t.consumer_engine_id}",
            transfer_id=t.transfer_id,
        )
    renewed = Reservation(request.transfer_id, engine.engine_id, engine.incarnation, request.blocks, now + ttl)
    if existing is not None:
        holder_live = existing.expires_at > now
        same = (existing.engine_id, existing.incarnation, existing.blocks) == (
            engine.engine_id,
            engine.incarnation,
            request.blocks,
        )
        if same and holder_live:
            return renewed
        if holder_live and existing.engine_id != engine.engine_id:
            raise RendezvousError(
                Reason.CREDIT_CONFLICT,
                f"transfer {request.transfer_id} holds credit on engine {existing.engine_id}; release it first",
                transfer_id=request.transfer_id,
                engine_id=existing.engine_id,
            )
        if holder_live and existing.incarnation == engine.incarnation:
            raise RendezvousError(
                Reason.CREDIT_CONFLICT,
                f"transfer {request.transfer_id} holds credit for {existing.blocks} blocks, not {request.blocks}",
                transfer_id=request.transfer_id,
                engine_id=existing.engine_id,
                blocks=existing.blocks,
            )
    others = sum(1 for r in ledger if r.expires_at > now and r.transfer_id != request.transfer_id)
    if others >= limits.max_credits_per_engine:
        raise RendezvousError(
            Reason.ENGINE_CAPACITY_EXCEEDED,
            f"engine {engine.engine_id} holds {others} credit reservations, the most one engine may",
            engine_id=engine.engine_id,
            limit="reservations",
            max=limits.max_credits_per_engine,
        )
    _fit(engine, spent, 1, request.blocks)
    return renewed


def check_reserved_elsewhere(consumer: Engine, transfer_id: str, reservation: Reservation | None, now: float) -> None:
    """A router that reserved a transfer's credit on a consumer chose that consumer: another consumer's
    RegisterTargets for the transfer is CREDIT_CONFLICT while the reservation lasts (it names no engine)."""
    if reservation is not None and reservation.engine_id != consumer.engine_id and reservation.expires_at > now:
        raise RendezvousError(
            Reason.CREDIT_CONFLICT,
            f"transfer {transfer_id}'s credit is reserved on another consumer: the router chose that one",
            transfer_id=transfer_id,
        )


def target_admission(
    engine: Engine, spent: EngineCredits, cur: Transfer | None, reservation: Reservation | None, blocks: int, now: float
) -> EngineCredits:
    """The engine's usage once a RegisterTargets of `blocks` on cur applies, or ENGINE_CAPACITY_EXCEEDED when
    its capacity has no room for it.

    A target the engine already holds for the transfer (a re-registration) gives back its blocks; a
    reservation for the transfer on this engine gives back its transfer and blocks: the target takes their
    place (so a reserved request is admitted whatever arrived since, unless it asks for more blocks).
    """
    if cur is not None and cur.consumer_engine_id == engine.engine_id and cur.unsettled:
        old = len(cur.target_block_ids)
        after = replace(spent, blocks_in_use=spent.blocks_in_use + blocks - old)
        add_transfers, add_blocks = 0, blocks - old
    elif reservation is not None and counts(reservation, engine, cur, now):
        after = EngineCredits(
            spent.transfers_in_use + 1,
            spent.blocks_in_use + blocks,
            spent.transfers_reserved - 1,
            spent.blocks_reserved - reservation.blocks,
        )
        add_transfers, add_blocks = 0, blocks - reservation.blocks
    else:
        after = replace(spent, transfers_in_use=spent.transfers_in_use + 1, blocks_in_use=spent.blocks_in_use + blocks)
        add_transfers, add_blocks = 1, blocks
    if add_transfers > 0 or add_blocks > 0:
        _fit(engine, spent, add_transfers, max(add_blocks, 0))
    return after
