"""Replica-test fixtures: Redis from tests.redis_fixtures, and two replicas on one Redis namespace."""

from collections.abc import Iterator

import pytest

from tests.redis_fixtures import fresh_prefix, redis_aof_server, redis_server, redis_url, with_prefix
from tests.replicas.harness import Replica, two_replicas

__all__ = ["redis_aof_server", "redis_server", "redis_url", "replicas"]


@pytest.fixture
def replicas(redis_url: str) -> Iterator[tuple[Replica, Replica]]:
    """Two replicas on one Redis namespace."""
    with two_replicas(with_prefix(redis_url, fresh_prefix())) as pair:
        yield pair
