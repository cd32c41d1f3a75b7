"""Quotas end to end: 429 with Retry-After and x-ratelimit-*, one budget across gateways
sharing Redis, and keys added and revoked in Redis without a restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.auth.principal import hash_key
from gateway.cli import main as kvgate
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines
from tests.store.conftest import RedisServer

MODEL = "kvgate-sim"


def chat(max_tokens: int = 2) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }


def replicas(engines: list[SimEngine]) -> list[dict[str, Any]]:
    return [{"id": f"e{e.index}", "url": e.url, "models": [MODEL]} for e in engines]


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(2, "instant") as engines:
        yield engines


async def test_requests_per_minute_get_429_with_retry_after_and_ratelimit_headers(
    engines: list[SimEngine],
) -> None:
    keys = [{"name": "k", "key_sha256": hash_key("sk-k"), "limits": {"requests_per_minute": 3}}]
    async with (
        gateway(engines, replicas=replicas(engines), auth={"keys": keys}) as gw,
        httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer sk-k"}) as http,
    ):
        answers = [await http.post("/v1/chat/completions", json=chat()) for _ in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers[:3]] == ["2", "1", "0"]
    assert all(r.headers["x-ratelimit-limit-requests"] == "3" for r in answers)
    refused = answers[3]
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    # Three requests in the current minute, none before it: room only once this minute has
    # passed and 1/3 of the next one too (the sliding window), so 60 to 80 s from now.
    wait = float(refused.headers["retry-after-ms"]) / 1000
    elapsed = time.time() / 60 % 1
    assert wait == pytest.approx((1 - elapsed) * 60 + 20, abs=1.0)
    assert int(refused.headers["retry-after"]) == int(wait + 0.999)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


async def test_output_tokens_per_minute_settled_from_usage(engines: list[SimEngine]) -> None:
    tenants = {"acme": {"limits": {"output_tokens_per_minute": 5}}}
    keys = [{"name": "k", "key_sha256": hash_key("sk-k"), "tenant": "acme"}]
    async with (
        gateway(engines, replicas=replicas(engines), auth={"keys": keys, "tenants": tenants}) as gw,
        httpx.AsyncClient(base_url=gw.url, headers={"authorization": "Bearer sk-k"}) as http,
    ):
        answers = [await http.post("/v1/chat/completions", json=chat(2)) for _ in range(4)]
    # 2 + 2 tokens leave room, the third takes the budget to 6, the fourth is refused.
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    assert answers[0].headers["x-ratelimit-limit-tokens"] == "5"
    assert answers[2].headers["x-ratelimit-remaining-tokens"] == "1"
    assert "output tokens" in answers[3].json()["error"]["message"]
    assert answers[3].headers["x-ratelimit-remaining-tokens"] == "0"


async def _two_gateways(
    stack: AsyncExitStack,
    engines: list[SimEngine],
    redis_url: str,
    prefix: str,
    auth: dict[str, Any],
) -> list[RunningGateway]:
    store = {"backend": "redis", "url": redis_url, "key_prefix": prefix}
    return [
        await stack.enter_async_context(
            gateway(
                engines,
                replicas=replicas(engines),
                store=store,
                auth=auth,
                models={"discover": False},
            )
        )
        for _ in range(2)
    ]


async def test_two_gateways_sharing_redis_enforce_one_budget(
    engines: list[SimEngine], redis_server: RedisServer, key_prefix: str
) -> None:
    budget = 40
    keys = [
        {"name": "k", "key_sha256": hash_key("sk-k"), "limits": {"requests_per_minute": budget}}
    ]
    async with AsyncExitStack() as stack:
        gws = await _two_gateways(stack, engines, redis_server.url, key_prefix, {"keys": keys})
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=g.url, headers={"authorization": "Bearer sk-k"})
            )
            for g in gws
        ]

        statuses: list[int] = []

        async def worker(w: int) -> None:
            for _ in range(2 * budget // 8):
                r = await clients[w % 2].post("/v1/chat/completions", json=chat(1))
                statuses.append(r.status_code)

        await asyncio.gather(*(worker(w) for w in range(8)))
    served = statuses.count(200)
    assert statuses.count(200) + statuses.count(429) == 2 * budget
    assert abs(served - budget) <= budget * 0.05, served


async def test_a_key_revoked_in_redis_is_refused_by_another_gateway_within_a_second(
    engines: list[SimEngine], redis_server: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    carol_key = tmp_path / "carol.key"
    carol_key.write_text("sk-carol\n")
    redis_args = ["--redis", redis_server.url, "--prefix", key_prefix]
    # One static admin key turns keys on; the shared one is added and revoked with the CLI.
    keys = [{"name": "ops", "key_sha256": hash_key("sk-ops"), "admin": True}]
    auth = {"keys": keys, "redis_keys": True, "redis_refresh_s": 0.2}
    async with AsyncExitStack() as stack:
        gws = await _two_gateways(stack, engines, redis_server.url, key_prefix, auth)
        assert (
            kvgate(
                [
                    "keys",
                    "add",
                    *redis_args,
                    "--name",
                    "carol",
                    "--key-file",
                    str(carol_key),
                    "--tenant",
                    "t1",
                ]
            )
            == 0
        )
        headers = {"authorization": "Bearer sk-carol"}
        async with httpx.AsyncClient() as http:

            async def status(g: RunningGateway) -> int:
                r = await http.post(g.url + "/v1/chat/completions", json=chat(1), headers=headers)
                return r.status_code

            deadline = time.monotonic() + 1.0
            while [await status(g) for g in gws] != [200, 200]:
                assert time.monotonic() < deadline, "the added key was not accepted within 1 s"
                await asyncio.sleep(0.05)
            assert kvgate(["keys", "revoke", *redis_args, "carol"]) == 0
            revoked_at = time.monotonic()
            while await status(gws[1]) != 401:
                assert time.monotonic() - revoked_at < 1.0, "the revoked key still works after 1 s"
                await asyncio.sleep(0.05)
