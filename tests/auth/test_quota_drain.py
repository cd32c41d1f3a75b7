"""The issue's two drains, against a gateway on loopback: streams dropped midway pay for
what they got, prompts dropped after their first token pay for their prefill."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

from gateway.auth.principal import hash_key
from gateway.testing.servers import RunningGateway, gateway, replica_config, sim_engines
from tests.auth.attacks import MODEL, clear_of_a_window_edge, drained_input, drained_output
from tests.store.conftest import RedisServer


async def settled(gws: list[RunningGateway], requests: int, within_s: float = 10.0) -> None:
    """Wait until `gws` have counted `requests` finished requests of key k between them."""
    deadline = time.monotonic() + within_s
    while True:
        counted = 0.0
        for g in gws:
            for metric in g.state.metrics.registry.collect():
                if metric.name == "kvgate_key_requests":
                    counted += sum(
                        sample.value
                        for sample in metric.samples
                        if sample.name.endswith("_total") and sample.labels["key"] == "k"
                    )
        if counted >= requests:
            return
        assert time.monotonic() < deadline, (counted, requests)
        await asyncio.sleep(0.02)


def _auth(limits: dict[str, int]) -> dict[str, Any]:
    return {"keys": [{"name": "k", "key_sha256": hash_key("sk-k"), "limits": limits}]}


async def test_streams_dropped_at_300_tokens_hit_the_output_budget() -> None:
    async with (
        sim_engines(1, "tiny") as engines,
        gateway(
            engines,
            auth=_auth({"output_tokens_per_minute": 2000}),
            models={"discover": False},
            replicas=replica_config(engines, models=[MODEL]),
        ) as gw,
    ):
        await clear_of_a_window_edge(8.0)
        got = await drained_output(gw.url, "sk-k", streams=12, read=300)
    served = [g for g in got if isinstance(g, int)]
    # Before: 12 x 300 = 3,600 tokens and no 429. Each dropped stream now keeps what it got
    # charged (at least 300, more when the gateway had relayed further before the drop).
    assert "429" in got, got
    assert all(g >= 300 for g in served)
    assert len(served) <= 7 and got[len(served) :] == ["429"] * (12 - len(served))


async def test_prompts_dropped_after_the_first_token_hit_the_input_budget() -> None:
    async with (
        # Real-ish prefill and decode: each stream is still running when it is dropped.
        sim_engines(1, "h200-sparse") as engines,
        gateway(
            engines,
            auth=_auth({"input_tokens_per_minute": 20000}),
            models={"discover": False},
            replicas=replica_config(engines, models=[MODEL]),
        ) as gw,
    ):
        await clear_of_a_window_edge(8.0)
        got = await drained_input(gw.url, "sk-k", prompts=10)
    # Before: 42K tokens prefilled against 20K, the counter never moved. Now five prompts
    # (21K) spend it and the sixth is refused.
    assert got == [1] * 5 + ["429"] * 5, got


async def test_two_gateways_on_one_redis_share_the_drained_budget(
    redis_server: RedisServer, key_prefix: str
) -> None:
    store = {"backend": "redis", "url": redis_server.url, "key_prefix": key_prefix}
    async with AsyncExitStack() as stack:
        engines = await stack.enter_async_context(sim_engines(1, "tiny"))
        gws = [
            await stack.enter_async_context(
                gateway(
                    engines,
                    store=store,
                    auth=_auth({"output_tokens_per_minute": 2000}),
                    models={"discover": False},
                    replicas=replica_config(engines, models=[MODEL]),
                )
            )
            for _ in range(2)
        ]
        got: list[int | str] = []
        await clear_of_a_window_edge(15.0)
        for i in range(12):  # alternate gateways: each sees the other's drops
            got += await drained_output(gws[i % 2].url, "sk-k", streams=1, read=300)
            # The dropped stream is settled (its gateway noticed the client left and counted
            # it), then its charge's background write reaches Redis. A fixed pause was too
            # short on a busy host: the other gateway admitted an eighth stream.
            await settled(gws, sum(isinstance(g, int) for g in got))
            await asyncio.sleep(0.05)
    served = [g for g in got if isinstance(g, int)]
    assert "429" in got and len(served) <= 7, got
