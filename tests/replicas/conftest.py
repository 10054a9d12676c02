"""Replica-test fixtures: Redis from tests.redis_fixtures, and two replicas on one Redis namespace."""

from collections.abc import Iterator

import pytest

from tests.redis_fixtures import fresh_prefix, redis_aof_server, redis_server, redis_url, with_prefix
from tests.replicas.harness import Replica

__all__ = ["redis_aof_server", "redis_server", "redis_url", "replicas"]


@pytest.fixture
def replicas(redis_url: str) -> Iterator[tuple[Replica, Replica]]:
    """Two replicas on one Redis namespace."""
    url = with_prefix(redis_url, fresh_prefix())
    a, b = Replica(url, "a"), Replica(url, "b")
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        a.close()
        b.close()
