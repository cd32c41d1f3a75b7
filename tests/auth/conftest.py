from tests.store.conftest import key_prefix, redis_server  # noqa: F401  (shared fixtures)
