"""Open a store from its URL: `memory`, or a Redis URL (redis://, rediss://, unix://, redis+sentinel://)."""

from __future__ import annotations

from collections.abc import Callable

from rendezvous.core.limits import Limits
from rendezvous.store.base import Store
from rendezvous.store.memory import MemoryStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://")


def create_store(url: str, limits: Limits, clock: Callable[[], float] | None = None) -> Store:
    """A store for url; raises ValueError naming the accepted forms for anything else. clock, when given, is what
    the memory store's kept answers expire by (Redis expires them itself)."""
    bounds = {
        "max_events_per_engine": limits.max_events_per_engine,
        "max_event_bytes_per_engine": limits.max_event_bytes_per_engine,
        "max_event_bytes_per_identity": limits.max_event_bytes_per_identity,
        "max_event_bytes_total": limits.max_event_bytes_total,
        "max_answers_bytes": limits.max_answers_bytes,
        "max_answers_bytes_per_identity": limits.max_answers_bytes_per_identity,
    }
    if url == "memory":
        return MemoryStore(limits=limits, **bounds, clock=clock)
    if url.startswith(REDIS_SCHEMES):
        from rendezvous.store.redis import RedisStore

        return RedisStore(url, limits=limits, **bounds)
    raise ValueError(f"unknown store {url!r}: use 'memory' or a URL starting with one of {', '.join(REDIS_SCHEMES)}")
