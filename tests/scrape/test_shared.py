"""`ScrapeShare` against a real redis-server: leases split, expire and fall back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.scrape.config import EngineKind
from gateway.scrape.shared import ScrapeShare, decode, encode
from gateway.store.keys import StoreKeys
from gateway.types import EngineLoad, ReplicaId
from tests.store.conftest import RedisServer

pytestmark = [pytest.mark.redis]

REPLICAS = [ReplicaId(f"e{i}") for i in range(24)]


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    r = Redis(port=redis_server.port)
    yield r
    await r.aclose()


def share(client: Redis | None, prefix: str, me: str, ttl: float = 0.6) -> ScrapeShare:
    return ScrapeShare(lambda: client, StoreKeys(prefix), me, lease_ttl_s=ttl)


async def settle(shares: list[ScrapeShare], rounds: int = 3) -> None:
    # Lease rounds run every third of the TTL: step past it each time.
    for _ in range(rounds):
        for s in shares:
            s._last_lease = -float("inf")
            await s.round(REPLICAS)


async def test_two_gateways_split_every_engine_between_them(client: Redis, key_prefix: str) -> None:
    a, b = share(client, key_prefix, "a"), share(client, key_prefix, "b")
    await settle([a, b])
    assert a.owned is not None and b.owned is not None
    assert a.owned.isdisjoint(b.owned)
    assert a.owned | b.owned == set(REPLICAS)
    # Rendezvous hashing spreads them (24 engines: one side empty is a 2**-23 event).
    assert a.owned and b.owned
    assert a.members == b.members == ("a", "b")
    # Every key of a round sits in one hash slot (Redis Cluster).
    keys = [k.decode() async for k in client.scan_iter(f"{key_prefix}:*")]
    assert keys and all("{scrape}" in k for k in keys)


async def test_loads_go_out_with_their_age_and_are_taken_in_once(
    client: Redis, key_prefix: str
) -> None:
    a, b = share(client, key_prefix, "a"), share(client, key_prefix, "b")
    await settle([a, b])
    assert a.owned is not None
    mine = min(a.owned)
    a.offer(mine, EngineLoad(3.0, 2.0, 0.5, 0.25, 1000), EngineKind.VLLM)
    await a.round(REPLICAS)
    await asyncio.sleep(0.2)
    taken = await b.round(REPLICAS)
    load, kind = taken[mine]
    assert (load.waiting, load.running, load.kv_usage, load.prefix_hit_rate) == (3, 2, 0.5, 0.25)
    assert load.kv_capacity_tokens == 1000 and kind is EngineKind.VLLM
    age = b._clock() - load.scraped_at
    assert 0.15 < age < 2.0
    assert mine not in await b.round(REPLICAS)  # nothing new: not taken in again


async def test_a_dead_holders_engines_are_taken_over_within_the_ttl(
    client: Redis, key_prefix: str
) -> None:
    ttl = 0.6
    a, b = share(client, key_prefix, "a", ttl), share(client, key_prefix, "b", ttl)
    await settle([a, b])
    assert b.owned is not None and b.owned != set(REPLICAS)
    # `a` stops renewing (it died): `b` runs its rounds as the scraper would.
    loop = asyncio.get_running_loop()
    died = loop.time()
    while b.owned != set(REPLICAS):
        assert loop.time() - died < ttl * 4 / 3 + 0.5, "no takeover"
        await asyncio.sleep(0.05)
        await b.round(REPLICAS)
    assert b.members == ("b",)


async def test_a_holder_never_loses_a_lease_it_renews(client: Redis, key_prefix: str) -> None:
    a, b = share(client, key_prefix, "a"), share(client, key_prefix, "b")
    await settle([a, b])
    before = (a.owned, b.owned)
    for _ in range(5):
        await settle([b, a], rounds=1)
        await asyncio.sleep(0.2)
    assert (a.owned, b.owned) == before


async def test_store_down_scrapes_everything_here(own_redis: RedisServer, key_prefix: str) -> None:
    client = Redis(port=own_redis.port, socket_connect_timeout=0.2, socket_timeout=0.2)
    try:
        a, b = share(client, key_prefix, "a"), share(client, key_prefix, "b")
        await settle([a, b])
        assert a.owned != set(REPLICAS)
        own_redis.kill()
        assert await a.round(REPLICAS) == {}
        assert not a.sharing and all(a.owns(r) for r in REPLICAS)
        own_redis.start()
        await settle([a, b])
        assert a.sharing and a.owned is not None and a.owned | (b.owned or set()) == set(REPLICAS)
    finally:
        await client.aclose()


async def test_a_degraded_store_is_not_asked() -> None:
    s = share(None, "x", "a")
    assert await s.round(REPLICAS) == {}
    assert not s.sharing and s.owns(REPLICAS[0])


def test_an_entry_another_version_wrote_is_ignored() -> None:
    assert decode(b"[1,2]") is None and decode(b"not json") is None
    raw = encode(EngineLoad(1.0, 2.0, engine=False), None, 5.0)
    shared = decode(raw)
    assert shared is not None and shared.load.engine is False and shared.at == 5.0
