"""Warm moves end to end: a session placed on the pricey pool follows the weights to the
cheap one only after its prompt was prefilled there, so its next turn hits the cache."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai

from gateway.keys import session_key
from gateway.pools.warm import warm_body
from gateway.sim.faults import FaultConfig
from gateway.sim.server import RequestRecord, SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines
from gateway.types import Endpoint, ReplicaId

MODEL = "small"
# Long enough that a cold prefill and a warm one differ by far more than the newest turn.
HISTORY = " ".join(f"fact {i}: the sky over harbour {i} was grey at noon." for i in range(50))


def pools(warm: bool, weights: dict[str, float] | None = None, **warm_moves: Any) -> dict[str, Any]:
    return {
        "pools": [
            {"name": "fast", "price_per_card_hour": 4.0, "slots_per_replica": 8},
            {"name": "cheap", "price_per_card_hour": 1.0, "slots_per_replica": 8},
        ],
        "models": [{"name": MODEL}],
        # Unless told otherwise, the weights give every session to the cheap pool from the
        # start. The controller keeps them, but samples utilisation often.
        "initial_weights": weights or {"fast": 0.0, "cheap": 1.0},
        "controller": {"enabled": False, "interval_s": 0.05},
        "warm_moves": {"enabled": warm, "min_interval_s": 0.0, **warm_moves},
    }


@contextlib.asynccontextmanager
async def two_pools(
    warm: bool, cheap_faults: FaultConfig | None = None, **warm_moves: Any
) -> AsyncIterator[RunningGateway]:
    async with two_pools_and_engines(warm, cheap_faults, **warm_moves) as (gw, _):
        yield gw


@contextlib.asynccontextmanager
async def two_pools_and_engines(
    warm: bool,
    cheap_faults: FaultConfig | None = None,
    weights: dict[str, float] | None = None,
    api_key: str | None = None,
    **warm_moves: Any,
) -> AsyncIterator[tuple[RunningGateway, list[SimEngine]]]:
    """The gateway and the cheap pool's engines (whose request logs show the warm-ups).
    With `api_key`, every engine requires it, as vLLM's `--api-key` does."""
    async with (
        sim_engines(1, "tiny", model_name=MODEL, time_scale=4.0, api_key=api_key) as fast,
        sim_engines(2, "tiny", model_name=MODEL, time_scale=4.0, api_key=api_key) as cheap,
    ):
        if cheap_faults is not None:
            for engine in cheap:
                await engine.set_faults(cheap_faults)
        # Models listed: discovery (GET /v1/models, keyless) is refused by keyed engines.
        replicas = [
            {"id": f"fast-{e.index}", "url": e.url, "pool": "fast", "models": [MODEL]} for e in fast
        ]
        replicas += [
            {"id": f"cheap-{e.index}", "url": e.url, "pool": "cheap", "models": [MODEL]}
            for e in cheap
        ]
        async with gateway(
            fast + cheap,
            replicas=replicas,
            pools=pools(warm, weights, **warm_moves),
            routing={"policy": "prefix_affinity"},
        ) as gw:
            yield gw, cheap


async def turn(
    client: openai.AsyncOpenAI, messages: list[dict[str, str]]
) -> tuple[str, int, int, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, extra_headers={"X-Session-Id": "conv"}
    )
    reply = raw.parse()
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    content = reply.choices[0].message.content or ""
    return raw.headers["x-kvgate-replica"], reply.usage.prompt_tokens, cached, content


async def conversation_after_a_peak(
    gw: RunningGateway, placed_on: str = "fast-0", api_key: str = "-"
) -> list[tuple[str, int, int]]:
    """A session placed on `placed_on` (the fast pool, as during a peak), then three turns."""
    assert gw.state.placements is not None
    key = session_key({}, Endpoint.CHAT, "conv", 0, [])[0]
    await gw.state.placements.record(key, ReplicaId(placed_on))
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key=api_key, max_retries=0
    ) as client:
        messages = [{"role": "user", "content": HISTORY}]
        seen = []
        for i in range(3):
            replica, prompt, cached, content = await turn(client, messages)
            seen.append((replica, prompt, cached))
            messages += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": f"and what about harbour {i}?"},
            ]
            await wait_for_warmups(gw)
        return seen


async def wait_for_warmups(gw: RunningGateway) -> None:
    runtime = gw.state.extras["pools"]
    for _ in range(200):
        if runtime.warmer is None or runtime.warmer.in_flight == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("warm-up never finished")


async def test_placed_session_moves_to_the_weighted_pool_with_its_prefix_warm() -> None:
    async with two_pools(warm=True) as gw:
        seen = await conversation_after_a_peak(gw)
        (first, _, _), (second, prompt2, cached2), (third, prompt3, cached3) = seen
        assert first == "fast-0"
        # The next turn runs on the cheap pool, with all but its newest turn cached there.
        assert second.startswith("cheap-")
        assert cached2 >= prompt2 - 64, seen
        assert third == second and cached3 >= prompt3 - 64, seen
        async with httpx.AsyncClient(base_url=gw.url) as http:
            admin = (await http.get("/admin/pools")).json()
            metrics = (await http.get("/metrics")).text
        assert admin["warm_moves"]["done"] == [
            {"from": "fast", "to": "cheap", "result": "ok", "count": 1}
        ]
        assert (
            'kvgate_pool_warm_moves_total{from_pool="fast",result="ok",to_pool="cheap"} 1.0'
            in metrics
        )
        # The warm-up is charged to the cheap pool's busy time but counts as no request.
        cost = admin["cost"]
        assert cost["cheap"]["requests"] == 2 and cost["fast"]["requests"] == 1
        assert cost["cheap"]["cost"]["busy"] > 0
        assert gw.state.cluster.view().inflight(ReplicaId(second)) == 0


async def test_without_warm_moves_the_session_stays_where_it_was_placed() -> None:
    async with two_pools(warm=False) as gw:
        seen = await conversation_after_a_peak(gw)
        assert [replica for replica, _, _ in seen] == ["fast-0"] * 3
        # Stickiness is what keeps the prefix: later turns hit the cache on fast-0.
        assert all(cached > 0 for _, _, cached in seen[1:])


async def test_session_waits_for_an_idle_replica_of_the_target_pool() -> None:
    async with two_pools(warm=True) as gw:
        cluster = gw.state.cluster
        busy = [ReplicaId("cheap-0"), ReplicaId("cheap-1")]
        for replica in busy:  # what a long request on each cheap replica would hold
            cluster.acquire(replica)
        assert gw.state.placements is not None
        key = session_key({}, Endpoint.CHAT, "conv", 0, [])[0]
        await gw.state.placements.record(key, ReplicaId("fast-0"))
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="-", max_retries=0
        ) as client:
            messages = [{"role": "user", "content": HISTORY}]
            replica, _, _, content = await turn(client, messages)
            assert replica == "fast-0"
            warmer = gw.state.extras["pools"].warmer
            await asyncio.sleep(0.5)
            assert warmer.waiting == 1 and warmer.in_flight == 0
            for replica in busy:
                cluster.release(replica)
            for _ in range(100):
                if warmer.waiting == 0 and warmer.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            messages += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": "and then?"},
            ]
            replica, prompt, cached, _ = await turn(client, messages)
            assert replica.startswith("cheap-") and cached >= prompt - 64


async def test_prompt_over_the_cap_is_not_warmed_and_the_skip_is_counted() -> None:
    async with two_pools(warm=True, max_prompt_tokens=64) as gw:
        seen = await conversation_after_a_peak(gw)
        assert [replica for replica, _, _ in seen] == ["fast-0"] * 3
        async with httpx.AsyncClient(base_url=gw.url) as http:
            warm = (await http.get("/admin/pools")).json()["warm_moves"]
        assert warm["done"] == [] and warm["skipped"] == {"too_long": 3}


async def test_failed_warm_up_leaves_the_session_where_it_was() -> None:
    # The cheap engines answer every generation request 400 (health probes still pass).
    async with two_pools(warm=True, cheap_faults=FaultConfig(error=400)) as gw:
        seen = await conversation_after_a_peak(gw)
        assert [replica for replica, _, _ in seen] == ["fast-0"] * 3
        async with httpx.AsyncClient(base_url=gw.url) as http:
            admin = (await http.get("/admin/pools")).json()
        assert admin["warm_moves"]["done"] == [
            {"from": "fast", "to": "cheap", "result": "failed", "count": 3}
        ]
        view = gw.state.cluster.view()
        assert all(view.inflight(r.id) == 0 for r in view.replicas)


async def test_no_move_onto_the_pricier_pool_while_the_sessions_own_pool_is_cool() -> None:
    # The weights give sessions to the fast pool, but the cheap one is idle: moving there
    # would pay a prefill on the pricier cards and buy nothing.
    to_fast = {"fast": 1.0, "cheap": 0.0}
    async with two_pools_and_engines(True, weights=to_fast) as (gw, _):
        await utilisation_sampled(gw)
        seen = await conversation_after_a_peak(gw, placed_on="cheap-0")
        assert [replica for replica, _, _ in seen] == ["cheap-0"] * 3
        warm = gw.state.extras["pools"].admin_payload()["warm_moves"]
        assert warm["done"] == [] and warm["skipped"] == {"pricier_pool_without_pressure": 3}
    # Switched off, the same session follows the weights onto the fast pool.
    async with two_pools_and_engines(True, weights=to_fast, pricier_only_under_pressure=False) as (
        gw,
        _,
    ):
        await utilisation_sampled(gw)
        seen = await conversation_after_a_peak(gw, placed_on="cheap-0")
        assert [replica for replica, _, _ in seen] == ["cheap-0", "fast-0", "fast-0"], seen
        warm = gw.state.extras["pools"].admin_payload()["warm_moves"]
        assert warm["done"] == [{"from": "cheap", "to": "fast", "result": "ok", "count": 1}]


async def utilisation_sampled(gw: RunningGateway) -> None:
    controller = gw.state.extras["pools"].controller
    for _ in range(100):
        if controller.snapshot.utilisation:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the controller never sampled utilisation")


async def test_warm_up_carries_the_clients_api_key_to_engines_that_require_one() -> None:
    async with two_pools_and_engines(True, api_key="sk-engine") as (gw, cheap):
        seen = await conversation_after_a_peak(gw, api_key="sk-engine")
        assert seen[0][0] == "fast-0" and seen[1][0].startswith("cheap-"), seen
        assert seen[1][2] >= seen[1][1] - 64, seen  # the warm-up was accepted: cached
        pieces = warm_records(cheap)
        assert pieces and all(p.status == 200 for p in pieces), pieces
        warm = gw.state.extras["pools"].admin_payload()["warm_moves"]
        assert warm["done"] == [{"from": "fast", "to": "cheap", "result": "ok", "count": 1}]
        # The engines do check: a request without the key is refused.
        async with httpx.AsyncClient(base_url=cheap[0].url) as http:
            refused = await http.post("/v1/chat/completions", json={"model": MODEL})
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}


def test_warm_body_keeps_the_prompt_and_asks_for_one_token() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"x": 1}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "min_tokens": 20,
        "max_completion_tokens": 500,
        "response_format": {"type": "json_object"},
        "temperature": 0.3,
    }
    warm = warm_body(body)
    assert warm == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"x": 1}],
        "temperature": 0.3,
        "max_tokens": 1,
        "stream": False,
    }
    assert body["stream"] is True  # the original is untouched


def warm_records(engines: list[SimEngine]) -> list[RequestRecord]:
    return [r for e in engines for r in e.request_log if r.request_id.endswith("-warm")]


async def test_sliced_warm_up_prefills_in_growing_pieces_and_moves_the_session() -> None:
    async with two_pools_and_engines(True, slice_tokens=128) as (gw, cheap):
        seen = await conversation_after_a_peak(gw)
        (first, _, _), (second, prompt2, cached2), _ = seen
        assert first == "fast-0" and second.startswith("cheap-")
        assert cached2 >= prompt2 - 64, seen
        pieces = warm_records(cheap)
        # One warm-up (one session moved once), sent as several growing prefixes; each
        # piece found the one before it cached.
        assert len(pieces) >= 3, pieces
        prompts = [p.prompt_tokens for p in pieces]
        assert prompts == sorted(prompts) and prompts[0] < prompts[-1]
        assert all(
            p.cached_tokens >= q.prompt_tokens - 32 for q, p in itertools.pairwise(pieces)
        ), pieces
        admin = gw.state.extras["pools"].admin_payload()["warm_moves"]
        assert admin["done"] == [{"from": "fast", "to": "cheap", "result": "ok", "count": 1}]


async def test_sliced_warm_up_pauses_while_a_live_request_holds_the_replica() -> None:
    # Each generation takes 0.2 s on the cheap engines, so the warm-up's pieces are visible.
    async with two_pools_and_engines(True, FaultConfig(slow=0.2), slice_tokens=128) as (gw, cheap):
        assert gw.state.placements is not None
        key = session_key({}, Endpoint.CHAT, "conv", 0, [])[0]
        await gw.state.placements.record(key, ReplicaId("fast-0"))
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="-", max_retries=0
        ) as client:
            replica, _, _, _ = await turn(client, [{"role": "user", "content": HISTORY}])
            assert replica == "fast-0"
            cluster = gw.state.cluster
            cheap_ids = [ReplicaId("cheap-0"), ReplicaId("cheap-1")]
            target = None
            for _ in range(200):
                target = next((r for r in cheap_ids if cluster.in_flight.get(r, 0) == 1), None)
                if target is not None:
                    break
                await asyncio.sleep(0.005)
            assert target is not None, "the warm-up never started"
            cluster.acquire(target)  # what a live request on that replica holds
            try:
                for _ in range(200):  # the first piece ends; the live one stays
                    if cluster.in_flight.get(target, 0) == 1:
                        break
                    await asyncio.sleep(0.005)
                done_before = len(warm_records(cheap))
                await asyncio.sleep(0.6)
                # Paused: no further piece went out while the replica was busy.
                assert cluster.in_flight.get(target, 0) == 1
                assert len(warm_records(cheap)) == done_before == 1
            finally:
                cluster.release(target)
            await wait_for_warmups(gw)
            assert len(warm_records(cheap)) >= 3
            assert cluster.in_flight.get(target, 0) == 0
