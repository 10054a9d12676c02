"""Store fixtures: one parametrised `store` per backend (memory, redis) and Redis from tests.redis_fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from rendezvous.core.limits import Limits
from rendezvous.store import MemoryStore, Store
from rendezvous.store.redis import RedisStore
from tests.redis_fixtures import (
    fresh_prefix,
    redis_aof_server,
    redis_cluster,
    redis_server,
    redis_url,
    sentinel_redis,
    with_prefix,
)

__all__ = ["redis_aof_server", "redis_cluster", "redis_server", "redis_url", "sentinel_redis"]

StoreFactory = Callable[..., Awaitable[Store]]


@pytest.fixture(
    params=["memory", pytest.param("redis", marks=pytest.mark.redis), pytest.param("cluster", marks=pytest.mark.redis)]
)
def backend(request: pytest.FixtureRequest) -> str:
    """The store backend under test: memory, Redis, or a Redis Cluster (through the cluster client)."""
    return str(request.param)


@pytest.fixture
async def make_store(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """Open stores of the backend under test. Redis stores of one test share a fresh namespace, like replicas."""
    opened: list[Store] = []
    url = ""
    if backend == "redis":
        url = with_prefix(request.getfixturevalue("redis_url"), fresh_prefix())
    elif backend == "cluster":
        url = with_prefix(request.getfixturevalue("redis_cluster").url, fresh_prefix())

    async def make(
        max_events_per_engine: int = 100_000,
        max_event_bytes_per_identity: int = Limits.max_event_bytes_per_identity,
        max_event_bytes_total: int = Limits.max_event_bytes_total,
    ) -> Store:
        store: Store
        if backend == "memory":
            store = MemoryStore(
                max_events_per_engine=max_events_per_engine,
                max_event_bytes_per_identity=max_event_bytes_per_identity,
                max_event_bytes_total=max_event_bytes_total,
            )
        else:
            store = RedisStore(
                url,
                max_events_per_engine=max_events_per_engine,
                max_event_bytes_per_identity=max_event_bytes_per_identity,
                max_event_bytes_total=max_event_bytes_total,
            )
        await store.open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


@pytest.fixture
async def store(make_store: StoreFactory) -> Store:
    """An open store of the backend under test."""
    return await make_store()


@pytest.fixture
async def redis_pair(redis_url: str) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    """Two Redis stores on one namespace: what two server replicas hold."""
    url = with_prefix(redis_url, fresh_prefix())
    a, b = RedisStore(url), RedisStore(url)
    await a.open()
    await b.open()
    yield a, b
    await a.close()
    await b.close()
