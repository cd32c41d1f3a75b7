"""A store that cannot reach Redis at start-up says so (issue 19, item 8)."""

from __future__ import annotations

import logging
import socket

import pytest
from prometheus_client import CollectorRegistry

from gateway.store.config import StoreSettings
from gateway.store.redis import RedisStore


async def test_starting_degraded_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    settings = StoreSettings(
        backend="redis", url=f"redis://:secret@127.0.0.1:{port}/0", connect_timeout_s=0.1
    )
    store = RedisStore(settings, registry=CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="kvgate.store"):
        await store.start()
    try:
        assert store.degraded
        (record,) = [r for r in caplog.records if "degraded" in r.getMessage()]
        assert f"127.0.0.1:{port}" in record.getMessage() and "secret" not in record.getMessage()
    finally:
        await store.close()
