"""Conformance-test fixtures: Redis from tests.redis_fixtures."""

from tests.redis_fixtures import redis_url

__all__ = ["redis_url"]
