"""The store tests' real redis-server fixtures, for the shared-scraping tests."""

from tests.store.conftest import key_prefix, own_redis, redis_server

__all__ = ["key_prefix", "own_redis", "redis_server"]
