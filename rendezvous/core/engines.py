"""Engine registrations, leases and the compatibility of producer and consumer layouts."""

from __future__ import annotations

from dataclasses import replace

from rendezvous.core.errors import Reason, RendezvousError
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Engine
from rendezvous.core.specs import EngineSpec
from rendezvous.core.validation import check_engine_spec


def grant_lease_ttl(requested: float, timeouts: Timeouts) -> float:
    """The lease the server grants: the request clamped to [min, max], or the default when zero."""
    if requested <= 0:
        return timeouts.default_lease_ttl
    return min(max(requested, timeouts.min_lease_ttl), timeouts.max_lease_ttl)


def register_engine(
    now: float, previous: Engine | None, spec: EngineSpec, limits: Limits, timeouts: Timeouts
) -> Engine:
    """A new incarnation of an engine.

    A live engine id may be re-registered (the engine restarted) but not under another role or
    pool: that is two engines sharing an id. Incarnations grow across server restarts too, since
    they start from the clock, so peers never confuse a restarted engine with its predecessor.
    """
    check_engine_spec(spec, limits)
    assert spec.role is not None
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
    )


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
    """The engine marked ended; it lingers as a tombstone so late calls get LEASE_EXPIRED."""
    return replace(engine, ended_at=now)


def layout_mismatch(producer: Engine, consumer: Engine) -> str | None:
    """Why the producer cannot write into the consumer's blocks, or None if it can."""
    p, c = producer.layout, consumer.layout
    for name in ("model_fingerprint", "dtype", "block_size", "num_layers", "tp_size", "pp_size", "kv_layout"):
        if getattr(p, name) != getattr(c, name):
            return f"{name} differs: producer {getattr(p, name)!r}, consumer {getattr(c, name)!r}"
    if len(producer.agents) != len(consumer.agents):
        return f"agent count differs: producer {len(producer.agents)}, consumer {len(consumer.agents)}"
    by_rank = {a.rank: a for a in consumer.agents}
    for pa in producer.agents:
        ca = by_rank[pa.rank]
        if [r.block_length_bytes for r in pa.regions] != [r.block_length_bytes for r in ca.regions]:
            return f"rank {pa.rank}: KV regions differ in count or block length"
    return None
