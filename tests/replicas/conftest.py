"""Replica-test fixtures: Redis from tests.redis_fixtures."""

from tests.redis_fixtures import redis_aof_server, redis_server, redis_url

__all__ = ["redis_aof_server", "redis_server", "redis_url"]
