"""`ModelsCache` against real servers that answer `/v1/models` badly: each bad replica is
left out of the listing, the good ones are still listed, and nothing raises."""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.cluster import Cluster
from gateway.models import ModelsCache
from gateway.serving import start_server
from gateway.testing.servers import sim_engines
from gateway.types import ReplicaId, ReplicaState
from gateway.upstream import Timeouts, make_client


def _answering(status: int, body: bytes) -> Starlette:
    async def models(request: Request) -> Response:
        return Response(body, status_code=status, media_type="application/json")

    return Starlette(routes=[Route("/v1/models", models)])


BAD_ANSWERS = {
    "status-500": (500, b'{"data": [{"id": "never"}]}'),
    "not-json": (200, b"<html>oops</html>"),
    "a-list": (200, b'[{"id": "never"}]'),
    "data-not-a-list": (200, b'{"data": {"id": "never"}}'),
}


@pytest.mark.parametrize("answer", sorted(BAD_ANSWERS))
async def test_a_replica_with_a_bad_models_answer_is_left_out(answer: str) -> None:
    status, body = BAD_ANSWERS[answer]
    bad = await start_server(_answering(status, body))
    client = make_client("h1", Timeouts(2.0, 2.0, 2.0))
    try:
        async with sim_engines(1, model_name="good") as (engine,):
            cluster = Cluster(
                [
                    ReplicaState(ReplicaId("ok"), engine.url),
                    ReplicaState(ReplicaId("bad"), bad.url),
                ]
            )
            cache = ModelsCache(cluster, client, ttl_s=60.0, timeout_s=2.0)
            listing = orjson.loads(await cache.body())
            assert [c["id"] for c in listing["data"]] == ["good"]
            assert cache.served == frozenset({"good"})
            # The bad replica's models stay unknown, so the gateway does not refuse a model
            # by name: it may be the one the bad replica serves.
            assert cluster.known_models() is None
            assert await cache.card("never") is None
            card = await cache.card("good")
            assert card is not None and orjson.loads(card)["id"] == "good"
    finally:
        await client.aclose()
        await bad.stop()


async def test_cards_without_a_string_id_are_dropped_and_adapters_found() -> None:
    body = orjson.dumps(
        {
            "data": [
                {"id": "base"},
                {"id": "base-lora", "parent": "base"},
                {"id": 7},
                "junk",
            ]
        }
    )
    server = await start_server(_answering(200, body))
    client = make_client("h1", Timeouts(2.0, 2.0, 2.0))
    try:
        cluster = Cluster([ReplicaState(ReplicaId("r"), server.url)])
        cache = ModelsCache(cluster, client, ttl_s=60.0, timeout_s=2.0)
        await cache.refresh()
        assert cache.served == frozenset({"base", "base-lora"})
        assert cache.adapters == frozenset({"base-lora"})
    finally:
        await client.aclose()
        await server.stop()


async def test_an_unreachable_or_unhealthy_replica_contributes_nothing() -> None:
    client = make_client("h1", Timeouts(1.0, 1.0, 1.0))
    try:
        async with sim_engines(2, model_name="m") as engines:
            refused = engines[1].url
            await engines[1].stop()
            states = [ReplicaState(ReplicaId("up"), engines[0].url)]
            states.append(ReplicaState(ReplicaId("down"), refused))
            cluster = Cluster(states)
            cache = ModelsCache(cluster, client, ttl_s=60.0, timeout_s=1.0)
            await cache.refresh()
            assert cache.served == frozenset({"m"})
            cluster.set_healthy(ReplicaId("up"), False)
            await cache.refresh()
            assert cache.served == frozenset()
    finally:
        await client.aclose()


async def test_the_listing_is_cached_until_its_ttl_runs_out() -> None:
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    calls: list[int] = []

    async def models(request: Request) -> Response:
        calls.append(1)
        return Response(orjson.dumps({"data": [{"id": f"m{len(calls)}"}]}))

    server = await start_server(Starlette(routes=[Route("/v1/models", models)]))
    client = make_client("h1", Timeouts(2.0, 2.0, 2.0))
    try:
        cluster = Cluster([ReplicaState(ReplicaId("r"), server.url)], clock=clock)
        cache = ModelsCache(cluster, client, ttl_s=10.0, timeout_s=2.0)
        first = await cache.body()
        now[0] = 9.9
        assert await cache.body() == first and len(calls) == 1
        now[0] = 10.0
        assert orjson.loads(await cache.body())["data"][0]["id"] == "m2"
    finally:
        await client.aclose()
        await server.stop()
