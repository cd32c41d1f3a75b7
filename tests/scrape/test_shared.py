"""`ScrapeShare` against a real redis-server: leases split, expire and fall back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

import gateway.scrape.shared as shared_module
from gateway.scrape import MetricsScraper, ScrapeSettings
from gateway.scrape.config import EngineKind
from gateway.scrape.shared import ScrapeShare, decode, encode
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import get_profile
from gateway.store.keys import StoreKeys
from gateway.types import EngineLoad, ReplicaId, ReplicaState
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


async def test_the_shared_round_runs_once_per_lease_period_while_all_is_quiet(
    client: Redis, key_prefix: str
) -> None:
    settings = ScrapeSettings(interval_s=0.05, idle_interval_s=0.5, lease_ttl_s=0.6)
    async with SimCluster(4, get_profile("instant")) as sim:
        targets = [ReplicaState(ReplicaId(f"e{i}"), url) for i, url in enumerate(sim.urls)]
        in_flight: dict[ReplicaId, int] = {}
        scrapers = [
            MetricsScraper(
                settings,
                lambda: targets,
                share=share(client, key_prefix, me, ttl=settings.lease_ttl_s),
                in_flight=in_flight,
            )
            for me in ("a", "b")
        ]
        for scraper in scrapers:
            await scraper.start()
        try:
            a = scrapers[0]
            assert a.share is not None
            for _ in range(200):  # until every engine's load is in, quiet
                if len(a.loads) == 4 and all(load.grace_s for load in a.loads.values()):
                    break
                await asyncio.sleep(0.02)
            assert a.share_period() == pytest.approx(0.2)  # the lease period, not 0.05
            before = a.share.rounds
            await asyncio.sleep(1.0)
            quiet_rounds = a.share.rounds - before
            assert 3 <= quiet_rounds <= 7, quiet_rounds  # 20 at the busy rate
            # A request of this gateway: at once, then at the busy rate.
            before = a.share.rounds
            in_flight[targets[0].id] = 1
            a.wake(targets[0].id)
            await asyncio.sleep(0.02)
            assert a.share.rounds > before
            assert a.share_period() == settings.interval_s
            before = a.share.rounds
            await asyncio.sleep(0.5)
            assert a.share.rounds - before >= 6
        finally:
            for scraper in scrapers:
                await scraper.stop()


async def test_an_unchanged_entry_is_not_decoded_again(client: Redis, key_prefix: str) -> None:
    a, b = share(client, key_prefix, "a"), share(client, key_prefix, "b")
    await settle([a, b])
    assert b.owned
    theirs = sorted(b.owned)
    for replica in theirs:
        b.offer(replica, EngineLoad(waiting=0, running=0, scraped_at=0.0, grace_s=4.75), None)
    await b.round(REPLICAS)
    calls = 0
    real = shared_module.decode

    def counting(raw: bytes) -> Any:
        nonlocal calls
        calls += 1
        return real(raw)

    shared_module.decode = counting  # type: ignore[assignment]
    try:
        assert set(await a.round(REPLICAS)) == set(theirs)
        assert calls == len(theirs)
        assert await a.round(REPLICAS) == {}
        assert calls == len(theirs)  # the same bytes: not decoded again
    finally:
        shared_module.decode = real  # type: ignore[assignment]


async def evals(client: Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_eval", {}).get("calls", 0))


async def test_membership_rounds_run_the_lease_script_only_when_something_changed(
    client: Redis, key_prefix: str
) -> None:
    ttl = 0.6
    a, b = share(client, key_prefix, "a", ttl), share(client, key_prefix, "b", ttl)
    await settle([a, b])
    before, owned = await evals(client), (a.owned, b.owned)
    await settle([a, b], rounds=5)  # ten membership rounds, nothing changed
    assert await evals(client) == before  # was one script over every engine per round
    assert (a.owned, b.owned) == owned
    # The leases outlive many membership rounds and are renewed well before they end.
    pttl = await client.pttl(a.keys.scrape_lease(min(owned[0] or REPLICAS)))
    assert a.hold_s * 1000 * 0.5 < pttl <= a.hold_s * 1000
    a._last_claim -= a.hold_s / 3
    await settle([a], rounds=1)
    assert await evals(client) == before + 1
    # A new member: every gateway runs it in the round that sees it, and the work is split
    # three ways.
    c = share(client, key_prefix, "c", ttl)
    await settle([c, a, b], rounds=2)
    owners = [s.owned or frozenset() for s in (a, b, c)]
    assert all(owners) and sum(len(o) for o in owners) == len(REPLICAS)
    assert owners[0] | owners[1] | owners[2] == set(REPLICAS)


async def test_a_quiet_engine_another_gateway_begins_using_is_read_by_its_holder_at_once(
    client: Redis, key_prefix: str
) -> None:
    # Quiet engines are read every 10 s; the lease period (a quiet holder's round) is 0.2 s.
    settings = ScrapeSettings(interval_s=0.05, idle_interval_s=10.0, lease_ttl_s=0.6)
    async with SimCluster(4, get_profile("instant")) as sim:
        targets = [ReplicaState(ReplicaId(f"e{i}"), url) for i, url in enumerate(sim.urls)]
        flights: dict[str, dict[ReplicaId, int]] = {"a": {}, "b": {}}
        a, b = (
            MetricsScraper(
                settings,
                lambda: targets,
                share=share(client, key_prefix, me, ttl=settings.lease_ttl_s),
                in_flight=flights[me],
            )
            for me in ("a", "b")
        )
        for scraper in (a, b):
            await scraper.start()
        try:
            assert a.share is not None and b.share is not None
            for _ in range(300):  # every engine read, quiet, and split between the two
                if (
                    len(b.loads) == 4
                    and all(load.grace_s for load in b.loads.values())
                    and a.share.owned
                    and b.share.owned is not None
                    and set(a.share.owned).isdisjoint(b.share.owned)
                ):
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # the holders' first reads (busy, then quiet) are done
            held = min(a.share.owned or ())
            assert b.share.owned is not None and held not in b.share.owned
            assert held in a._quiet  # its poller waits out the quiet interval
            engine = sim.engines[int(held[1:])]
            before = engine.metrics_requests
            await asyncio.sleep(0.6)
            assert engine.metrics_requests == before  # quiet: not read again for 10 s
            # `b` begins sending the engine `a` holds a request: `a` reads it at once.
            flights["b"][held] = 1
            b.wake(held)
            loop = asyncio.get_running_loop()
            asked = loop.time()
            while engine.metrics_requests == before:
                assert loop.time() - asked < 2.0, "the holder did not read it"
                await asyncio.sleep(0.02)
            # An engine `b` holds itself is read by `b` (its own poller), no ask goes out.
            own = min(b.share.owned or ())
            b.wake(own)
            assert not b.share._wakes_out
        finally:
            for scraper in (a, b):
                await scraper.stop()


async def test_stop_ends_the_shared_loop_when_a_round_swallowed_the_cancel(
    client: Redis, key_prefix: str
) -> None:
    """redis-py can turn a cancellation inside a pipeline into a connection error, which a
    round takes as a store failure. The loop must still end: before, the next round's
    `asyncio.timeout` took its own expiry for that cancel and the loop ran on, and `stop`
    waited for it forever (seen under load in the suite)."""
    settings = ScrapeSettings(interval_s=0.05, idle_interval_s=0.5, lease_ttl_s=0.6)
    scraper = MetricsScraper(
        settings, list, share=share(client, key_prefix, "a", ttl=0.6), in_flight={}
    )
    await scraper.start()
    entered = asyncio.Event()

    async def swallowing_round() -> None:
        entered.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return  # as a pipeline that turned the cancel into an error the round handled

    scraper._share_round = swallowing_round  # type: ignore[method-assign]
    scraper._share_wakeup.set()
    await asyncio.wait_for(entered.wait(), 2)
    async with asyncio.timeout(3):
        await scraper.stop()
