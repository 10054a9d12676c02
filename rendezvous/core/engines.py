"""Engine registrations, leases and the compatibility of producer and consumer layouts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from rendezvous.core import credits
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Engine, Transfer, positional
from rendezvous.core.validation import check_engine_spec
from rendezvous.protocol import kvmap
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.protocol.requests import EngineSpec


def grant_lease_ttl(requested: float, timeouts: Timeouts) -> float:
    """The lease the server grants: the request clamped to [min, max], or the default when zero."""
    if requested <= 0:
        return timeouts.default_lease_ttl
    return min(max(requested, timeouts.min_lease_ttl), timeouts.max_lease_ttl)


def register_engine(
    now: float,
    previous: Engine | None,
    spec: EngineSpec,
    limits: Limits,
    timeouts: Timeouts,
    watch_start_sequence: int = 0,
) -> Engine:
    """A new incarnation of an engine.

    A live engine id may be re-registered (the engine restarted) but not under another role or
    pool: that is two engines sharing an id. Incarnations grow across server restarts too, since
    they start from the clock, so peers never confuse a restarted engine with its predecessor.
    """
    check_engine_spec(spec, limits)
    credits.check_capacity(spec.role, spec.capacity, limits)
    if previous is not None and previous.alive(now) and (previous.role, previous.pool) != (spec.role, spec.pool):
        raise RendezvousError(
            Reason.ENGINE_CONFLICT,
            f"engine {spec.engine_id} is live as {previous.role.name} in pool {previous.pool}",
            engine_id=spec.engine_id,
        )
    ttl = grant_lease_ttl(spec.lease_ttl, timeouts)
    incarnation = max(previous.incarnation + 1 if previous else 1, int(now * 1_000_000))
    return Engine(
        engine_id=spec.engine_id,
        pool=spec.pool,
        role=spec.role,
        layout=spec.layout,
        agents=spec.agents,
        labels=dict(spec.labels),
        incarnation=incarnation,
        lease_ttl=ttl,
        lease_expires_at=now + ttl,
        registered_at=now,
        unlost_incarnation=_unlost(previous),
        watch_start_sequence=watch_start_sequence,
        owner=spec.owner,
        capacity=spec.capacity,
    )


def _unlost(previous: Engine | None) -> int:
    """The incarnation a new registration replaces: its loss (and that of any before it) is still to apply."""
    return previous.incarnation if previous is not None else 0


def loss_applied(engine: Engine | None, incarnation: int) -> Engine | None:
    """The engine with its pending loss cleared, once the loss of incarnation (and all before) was applied."""
    if engine is None or not engine.unlost_incarnation or engine.unlost_incarnation > incarnation:
        return engine
    return replace(engine, unlost_incarnation=0)


def predecessor(engine: Engine, now: float) -> Engine:
    """The ended record of the incarnation engine replaced but whose loss is pending (same id and agents)."""
    return replace(engine, incarnation=engine.unlost_incarnation, ended_at=now, unlost_incarnation=0)


def check_incarnation(now: float, engine: Engine | None, engine_id: str, incarnation: int) -> Engine:
    """The caller's live engine; incarnation 0 skips the incarnation check."""
    if engine is None:
        raise RendezvousError(Reason.ENGINE_NOT_FOUND, f"engine {engine_id} is not registered", engine_id=engine_id)
    if incarnation and incarnation != engine.incarnation:
        raise RendezvousError(
            Reason.STALE_INCARNATION,
            f"engine {engine_id} incarnation {incarnation} was replaced by {engine.incarnation}",
            engine_id=engine_id,
            current_incarnation=engine.incarnation,
        )
    if not engine.alive(now):
        raise RendezvousError(
            Reason.LEASE_EXPIRED, f"engine {engine_id} lease expired; register again", engine_id=engine_id
        )
    return engine


def renew_lease(now: float, engine: Engine) -> Engine:
    """The engine with its lease extended by its TTL from now."""
    return replace(engine, lease_expires_at=now + engine.lease_ttl)


def end_incarnation(now: float, engine: Engine) -> Engine:
    """The engine marked ended; it lingers as a tombstone so late calls get LEASE_EXPIRED.

    A tombstone keeps no agent metadata, no regions and no labels (up to megabytes an engine, for
    tombstone_ttl): only each agent's name and rank, which a PEER_LOST event names so that peers forget that
    agent.
    """
    agents = tuple(replace(a, metadata=b"", regions=()) for a in engine.agents)
    return replace(engine, ended_at=now, agents=agents, labels={})


class Lapse(Enum):
    """Why the sweeper acts on an engine record (see `lapse`)."""

    LEASE_PASSED = "lease passed"
    """A live incarnation whose lease ran out: end it (its transfers abort, its peers are told)."""
    TOMBSTONE_AGED = "tombstone aged"
    """An ended incarnation kept tombstone_ttl already: forget the record."""


def lapse(engine: Engine, now: float, tombstone_ttl: float) -> Lapse | None:
    """The one rule for engine expiry: whether, and why, the sweeper acts on this record now.

    Stores may narrow the candidates by an index (a lease or end-time order), never decide.
    """
    if engine.ended_at:
        return Lapse.TOMBSTONE_AGED if engine.ended_at + tombstone_ttl <= now else None
    return None if engine.alive(now) else Lapse.LEASE_PASSED


def sweep_engine(now: float, tombstone_ttl: float, seen: Engine, cur: Engine | None) -> Engine | None:
    """The engine update the sweeper applies to `seen`, a record that had lapsed, on the record now stored.

    The lapse `seen` earned is applied only if the same incarnation still earns it: a lease renewed,
    an incarnation replaced or already ended meanwhile is left as it is.
    """
    verdict = lapse(seen, now, tombstone_ttl)
    if (
        verdict is None
        or cur is None
        or cur.incarnation != seen.incarnation
        or lapse(cur, now, tombstone_ttl) != verdict
    ):
        return cur
    return end_incarnation(now, cur) if verdict is Lapse.LEASE_PASSED else None


@dataclass(frozen=True, slots=True)
class LiveTransferLimit:
    """The live-transfer limit (max_live_transfers_per_engine) for calls of one engine.

    `room` is how many more unsettled transfers the engine may join. A call that would make it join
    one more is refused once there is no room; calls on transfers it already takes part in go through.
    """

    engine_id: str
    limit: int
    room: int

    @classmethod
    def of(cls, limits: Limits, engine: Engine, live: int) -> LiveTransferLimit:
        """The limit for an engine that takes part in `live` unsettled transfers now."""
        limit = limits.max_live_transfers_per_engine
        return cls(engine.engine_id, limit, limit - live)

    def allows(self, calls: int) -> bool:
        """Whether that many calls stay within the limit whatever they do (so they need no checking in order)."""
        return self.room >= calls

    def check(self, cur: Transfer | None) -> None:
        """Refuse a call on cur that would make the engine join one more transfer without room for it."""
        if self.room <= 0 and (cur is None or self.engine_id not in cur.participants()):
            raise RendezvousError(
                Reason.TOO_MANY_TRANSFERS,
                f"engine {self.engine_id} has {self.limit} live transfers",
                limit=self.limit,
            )

    def after(self, outcome: Transfer | None) -> LiveTransferLimit:
        """The limit after a call that left outcome: a live transfer takes room (counted even when the
        engine was in it already, which errs on the side of refusing)."""
        if outcome is None or outcome.state.terminal:
            return self
        return _live_transfer_limit(self.engine_id, self.limit, self.room - 1)  # per batch item: no frozen __init__


_live_transfer_limit = positional(LiveTransferLimit)


_PAIRS_KEPT = 64
_PAIR_METADATA_KEPT = 64 << 10
_pairs: dict[tuple[str, str], tuple[Engine, Engine, str | None]] = {}
"""The last verdict of each (producer, consumer) pair of engine ids, with the records it was reached for: a
pure function of the two records, asked on every match, so the answer holds while both are the same
objects. Bounded: at most _PAIRS_KEPT pairs, and none whose engines carry over _PAIR_METADATA_KEPT bytes of
agent metadata."""


def layout_mismatch(producer: Engine, consumer: Engine) -> str | None:
    """Why the producer cannot write into the consumer's blocks, or None if it can (`kvmap.layout_mismatch`)."""
    key = (producer.engine_id, consumer.engine_id)
    known = _pairs.get(key)
    if known is not None and known[0] is producer and known[1] is consumer:
        return known[2]
    found = kvmap.layout_mismatch(producer.layout, producer.agents, consumer.layout, consumer.agents)
    mismatch = None if found is None else str(found)
    if sum(len(a.metadata) for a in producer.agents + consumer.agents) <= _PAIR_METADATA_KEPT:
        if len(_pairs) >= _PAIRS_KEPT and key not in _pairs:
            _pairs.clear()
        _pairs[key] = (producer, consumer, mismatch)
    return mismatch
