"""RedisStore specifics: sharing between instances, expiry, bounds, outages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry

from gateway.store import PrefixPlacement, StoreSettings
from gateway.store.redis import RedisStore
from gateway.types import ReplicaId, SessionKey
from tests.store.conftest import RedisServer

pytestmark = pytest.mark.redis

R1, R2 = ReplicaId("r1"), ReplicaId("r2")
MakeStore = Callable[..., Awaitable[RedisStore]]


@pytest.fixture
async def make_store(key_prefix: str) -> AsyncIterator[MakeStore]:
    stores: list[RedisStore] = []

    async def make(server: RedisServer, **overrides: object) -> RedisStore:
        fields: dict[str, object] = {
            "backend": "redis",
            "url": server.url,
            "key_prefix": key_prefix,
            "sync_interval_s": 0.02,
            "op_timeout_s": 0.5,
        }
        fields.update(overrides)
        store = RedisStore(StoreSettings.model_validate(fields), registry=CollectorRegistry())
        await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


async def eventually(check: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_placements_are_shared_and_moves_pushed(
    make_store: MakeStore, redis_server: RedisServer
) -> None:
    a, b = await make_store(redis_server), await make_store(redis_server)
    s = SessionKey("conv")
    await a.assign_session(s, R1)
    await a.sync()
    assert await b.lookup_session(s) == R1  # one round trip, then cached locally
    await a.assign_session(s, R2)  # a move (failover): pushed, not waiting for a sync
    await eventually(lambda: b.local.local_peek(s) == R2, timeout=1.0)
    assert await b.lookup_session(s) == R2


async def test_concurrent_first_placements_converge(
    make_store: MakeStore, redis_server: RedisServer
) -> None:
    a, b = await make_store(redis_server), await make_store(redis_server)
    s = SessionKey("raced")
    await a.assign_session(s, R1)
    await b.assign_session(s, R2)  # b never saw a's placement: a first placement too
    await a.sync()
    await b.sync()
    # Whichever claim reached Redis first wins, and the other instance adopts it.
    winner = await a.lookup_session(s)
    assert winner in (R1, R2)
    assert await b.lookup_session(s) == winner


async def test_prefix_placements_reach_other_instances(
    make_store: MakeStore, redis_server: RedisServer
) -> None:
    a = await make_store(redis_server, prefix_hashes_shared=4)
    b = await make_store(redis_server)
    seen: list[PrefixPlacement] = []
    b.subscribe_prefixes(seen.append)
    hashes = (2**64 - 1, 1, 2, 3, 4, 5)
    a.publish_prefix(PrefixPlacement("m", R1, hashes, block_tokens=16))
    a.publish_prefix(PrefixPlacement("m", R1, hashes + (6,)))  # same leading blocks: deduped
    await a.sync()
    await eventually(lambda: bool(seen))
    await asyncio.sleep(0.1)
    assert len(seen) == 1
    assert seen[0].prefix_hashes == hashes[:4]
    assert (seen[0].model, seen[0].replica, seen[0].origin) == ("m", R1, a.instance_id)


async def test_ejections_shared_both_ways(make_store: MakeStore, redis_server: RedisServer) -> None:
    a, b = await make_store(redis_server), await make_store(redis_server)
    await a.eject_replica(R1, 30, "refused")
    await eventually(lambda: R1 in b.ejections(), timeout=1.0)
    assert b.ejections()[R1].reason == "refused"
    await b.readmit_replica(R1)
    await eventually(lambda: R1 not in a.ejections(), timeout=1.0)


async def test_forgotten_replica_is_purged_everywhere(
    make_store: MakeStore, redis_server: RedisServer
) -> None:
    a, b = await make_store(redis_server), await make_store(redis_server)
    for i in range(20):
        await a.assign_session(SessionKey(f"s{i}"), R1 if i % 2 else R2)
    await a.sync()
    for i in range(20):
        await b.lookup_session(SessionKey(f"s{i}"))
    await a.forget_replica(R1)
    await a.sync()
    client = redis_server.client()
    try:
        left = {client.get(k) for k in client.scan_iter(match=f"{a.keys.prefix}:sess:*")}
    finally:
        client.close()
    assert left == {b"r2"}
    await eventually(lambda: b.local.local_peek(SessionKey("s1")) is None, timeout=1.0)
    assert b.local.local_peek(SessionKey("s2")) == R2


async def test_keys_expire_as_configured_and_stay_bounded(
    make_store: MakeStore, redis_server: RedisServer
) -> None:
    store = await make_store(redis_server, session_ttl_s=0.5, prefix_stream_max=100)
    for i in range(200):
        await store.assign_session(SessionKey(f"s{i}"), R1)
        store.publish_prefix(PrefixPlacement("m", R1, (i, i + 1)))
    await store.eject_replica(R2, 0.5)
    await store.sync()
    client = redis_server.client()
    prefix = store.keys.prefix
    try:
        ttl = client.pttl(f"{prefix}:sess:s0")
        assert 0 < ttl <= 500
        assert client.xlen(f"{prefix}:prefixes") <= 200  # trimmed approximately (MAXLEN ~)
        await asyncio.sleep(1.2)
        await store.sync()
        assert list(client.scan_iter(match=f"{prefix}:sess:*")) == []
        # What remains: the trimmed stream and small per-replica hashes, nothing per session.
        remaining = list(client.scan_iter(match=f"{prefix}:*"))
        assert len(remaining) <= 3, remaining
    finally:
        client.close()
    assert store.status().sessions_cached == 0


async def test_redis_down_then_back_resynchronises(
    make_store: MakeStore, own_redis: RedisServer
) -> None:
    a = await make_store(own_redis, connect_timeout_s=0.2, reconnect_max_s=0.2)
    b = await make_store(own_redis, connect_timeout_s=0.2, reconnect_max_s=0.2)
    await a.assign_session(SessionKey("before"), R1)
    await a.sync()
    own_redis.kill()
    started = time.perf_counter()
    assert await b.lookup_session(SessionKey("unknown")) is None  # no error, bounded
    assert time.perf_counter() - started < 1.0
    await eventually(lambda: a.degraded and b.degraded)
    assert a.metrics.registry.get_sample_value("kvgate_store_degraded") == 1
    started = time.perf_counter()
    for i in range(50):  # degraded: local answers only, no Redis call at all
        assert await b.lookup_session(SessionKey(f"x{i}")) is None
    assert time.perf_counter() - started < 0.05
    await a.assign_session(SessionKey("during"), R2)
    assert await a.lookup_session(SessionKey("before")) == R1
    own_redis.start()  # empty: no persistence
    await eventually(lambda: not a.degraded and not b.degraded, timeout=10)
    # `a` pushed back what the restarted Redis lost; `b` reads it.
    assert await b.lookup_session(SessionKey("during")) == R2
    assert await b.lookup_session(SessionKey("before")) == R1
    assert a.metrics.registry.get_sample_value("kvgate_store_resyncs_total") >= 2
    # Pooled connections from before the restart were dropped at the resync: no second
    # degraded spell follows (each stale one used to fail once on first use).
    resyncs = [s.metrics.registry.get_sample_value("kvgate_store_resyncs_total") for s in (a, b)]
    for i in range(20):
        await a.assign_session(SessionKey(f"after{i}"), R1)
        await a.sync()
        assert await b.lookup_session(SessionKey(f"after{i}")) in (R1, None)
    await asyncio.sleep(0.3)
    assert not a.degraded and not b.degraded
    assert [
        s.metrics.registry.get_sample_value("kvgate_store_resyncs_total") for s in (a, b)
    ] == resyncs


async def test_slow_redis_costs_at_most_the_op_timeout(
    make_store: MakeStore, redis_server: RedisServer
) -> None:
    store = await make_store(redis_server, op_timeout_s=0.05)
    client = redis_server.client()
    try:
        sleeper = asyncio.get_running_loop().run_in_executor(
            None, lambda: client.execute_command("DEBUG", "SLEEP", "0.6")
        )
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        assert await store.lookup_session(SessionKey("slow")) is None
        assert time.perf_counter() - started < 0.2
        await sleeper
    finally:
        client.close()


def syncs(store: RedisStore) -> float:
    """How many syncs the store has run (its kvgate_store_sync_seconds count)."""
    for family in store.metrics.sync_seconds.collect():
        for sample in family.samples:
            if sample.name.endswith("_count"):
                return sample.value
    return 0.0


async def test_an_idle_store_syncs_once_a_second_and_wakes_for_writes_and_shared_prefixes(
    make_store: MakeStore, redis_server: RedisServer
) -> None:
    a = await make_store(redis_server, sync_interval_s=0.05)
    b = await make_store(redis_server, sync_interval_s=0.05)
    seen: list[PrefixPlacement] = []
    b.subscribe_prefixes(seen.append)
    # Ten syncs in a row with nothing written or pulled (half a second here): quiet.
    await eventually(lambda: a.quiet and b.quiet, timeout=3.0)
    before = syncs(b)
    await asyncio.sleep(1.5)
    assert syncs(b) - before <= 3  # 30 at the busy rate
    # A write on one: its sync runs at once, and tells the others to pull.
    started = time.monotonic()
    a.publish_prefix(PrefixPlacement("m", R1, (1, 2, 3), block_tokens=16))
    await eventually(lambda: bool(seen), timeout=3.0)
    assert time.monotonic() - started < 0.5  # not the quiet second
    assert not a.quiet  # the write brought back the busy rate
    # A placement that only refreshes a TTL (a continued session) wakes a quiet store too.
    await eventually(lambda: a.quiet, timeout=3.0)
    s = SessionKey("kept")
    await a.assign_session(s, R1)
    await a.sync()
    await eventually(lambda: a.quiet, timeout=3.0)
    before = syncs(a)
    await a.assign_session(s, R1)  # the same replica: a touch, which waits for a sync
    await eventually(lambda: syncs(a) > before, timeout=0.5)
