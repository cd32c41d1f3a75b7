"""One contract, two implementations: every test runs against MemoryStore and RedisStore."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.store import MemoryStore, PrefixPlacement, Store, StoreSettings, build_store
from gateway.store.redis import RedisStore
from gateway.types import ReplicaId, SessionKey
from tests.store.conftest import RedisServer

R1, R2, R3 = ReplicaId("r1"), ReplicaId("r2"), ReplicaId("r3")
StoreFactory = Callable[..., "asyncio.Future[Store]"]


@pytest.fixture(params=["memory", "redis"])
async def store_factory(
    request: pytest.FixtureRequest, key_prefix: str
) -> AsyncIterator[Callable[..., object]]:
    stores: list[Store] = []
    url = ""
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        url = server.url

    async def make(**overrides: object) -> Store:
        fields: dict[str, object] = {"backend": request.param, "key_prefix": key_prefix}
        if url:
            fields["url"] = url
        fields.update(overrides)
        store = build_store(StoreSettings.model_validate(fields))
        await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()


async def _settle(store: Store) -> None:
    await store.sync()


async def test_backend_matches_settings(store_factory: Callable[..., object]) -> None:
    store = await store_factory()  # type: ignore[misc]
    assert isinstance(store, Store)
    assert isinstance(store, MemoryStore | RedisStore)
    status = store.status()
    assert status.degraded is False
    assert status.backend in ("memory", "redis")


async def test_assign_lookup_and_move(store_factory: Callable[..., object]) -> None:
    store = await store_factory()  # type: ignore[misc]
    s = SessionKey("conv-1")
    assert await store.lookup_session(s) is None
    await store.assign_session(s, R1)
    assert await store.lookup_session(s) == R1
    await store.assign_session(s, R2)  # moved by bounded load or failover
    assert await store.lookup_session(s) == R2
    assert await store.lookup_session(SessionKey("conv-2")) is None


async def test_session_ttl_refreshed_on_use(store_factory: Callable[..., object]) -> None:
    # Margins of 0.4 s or more either way: a loaded CI host overshoots short sleeps.
    store = await store_factory(session_ttl_s=1.0, sync_interval_s=0.02)  # type: ignore[misc]
    kept, idle = SessionKey("kept"), SessionKey("idle")
    await store.assign_session(kept, R1)
    await store.assign_session(idle, R2)
    for _ in range(4):
        await asyncio.sleep(0.35)
        assert await store.lookup_session(kept) == R1
        await _settle(store)
    assert await store.lookup_session(idle) is None
    await asyncio.sleep(1.4)
    assert await store.lookup_session(kept) is None


async def test_forget_replica_drops_only_its_sessions(store_factory: Callable[..., object]) -> None:
    store = await store_factory()  # type: ignore[misc]
    for i in range(10):
        await store.assign_session(SessionKey(f"s{i}"), R1 if i % 2 else R2)
    await _settle(store)
    await store.forget_replica(R1)
    await _settle(store)
    for i in range(10):
        expected = None if i % 2 else R2
        assert await store.lookup_session(SessionKey(f"s{i}")) == expected


async def test_ejections_expire_and_readmit(store_factory: Callable[..., object]) -> None:
    store = await store_factory(sync_interval_s=0.02)  # type: ignore[misc]
    await store.eject_replica(R1, 0.4, "connect refused")
    await store.eject_replica(R2, 30, "5xx")
    await _settle(store)
    ejected = store.ejections()
    assert set(ejected) == {R1, R2}
    assert ejected[R1].reason == "connect refused"
    await store.readmit_replica(R2)
    await _settle(store)
    assert set(store.ejections()) == {R1}
    await asyncio.sleep(0.5)
    await _settle(store)
    assert dict(store.ejections()) == {}


async def test_own_prefix_placements_are_not_echoed(store_factory: Callable[..., object]) -> None:
    store = await store_factory(sync_interval_s=0.02)  # type: ignore[misc]
    seen: list[PrefixPlacement] = []
    store.subscribe_prefixes(seen.append)
    store.publish_prefix(PrefixPlacement("m", R1, (1, 2, 3)))
    await _settle(store)
    await asyncio.sleep(0.05)
    assert seen == []


async def test_response_links_name_the_chain_root(store_factory: Callable[..., object]) -> None:
    store = await store_factory()  # type: ignore[misc]
    assert await store.response_root("a2") is None
    await store.link_response("a2", "a1")
    await store.link_response("a3", "a1")
    assert await store.response_root("a2") == "a1"
    assert await store.response_root("a3") == "a1"
    await _settle(store)
    if isinstance(store, RedisStore):
        # Another instance, with nothing local, reads the link from Redis.
        other = await store_factory()  # type: ignore[misc]
        assert await other.response_root("a3") == "a1"
        assert await other.response_root("a4") is None
