"""Prefill/decode roles end to end: vLLM's kv_transfer_params relay and SGLang's bootstrap."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
from sim_helpers import chat_body, scrape, test_profile, value

from gateway.sim.cluster import SimCluster

PROMPT = "Summarise the following design document for a routing gateway. " * 8
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def test_vllm_two_stage_relay_completes_and_moves_kv() -> None:
    prof = test_profile(kv_bytes_per_token=2048)
    async with SimCluster(2, prof, roles=["prefill", "decode"]) as cluster:
        prefill, decode = cluster.engines
        async with httpx.AsyncClient() as c:
            body = chat_body(PROMPT, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
            r1 = await c.post(
                prefill.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "pd-1"}
            )
            assert r1.status_code == 200
            kv = r1.json()["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
            assert kv["remote_engine_id"] == prefill.engine_id
            assert (kv["remote_host"], kv["remote_port"]) == (prefill.host, prefill.port)
            assert kv["remote_request_id"] == "pd-1"
            assert len(kv["remote_block_ids"]) == r1.json()["usage"]["prompt_tokens"] // 16 + 1
            # The prefill engine keeps the KV until the decode engine takes it.
            assert prefill.model.is_held("pd-1") and prefill.blocks_in_use > 0

            async with openai.AsyncOpenAI(
                base_url=decode.url + "/v1", api_key="x", max_retries=0
            ) as client:
                stream = await client.chat.completions.create(
                    model="kvgate-sim",
                    messages=[{"role": "user", "content": PROMPT}],
                    max_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"kv_transfer_params": kv, "ignore_eos": True},
                    extra_headers={"X-Request-Id": "pd-1"},
                )
                chunks = [ch async for ch in stream]
                p_metrics = await scrape(c, prefill.url)
                d_metrics = await scrape(c, decode.url)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8
    prompt_tokens = usage.prompt_tokens
    assert not prefill.model.is_held("pd-1") and prefill.blocks_in_use == 0
    assert decode.blocks_in_use == 0
    record = decode.request_log[-1]
    assert record.pd == "decode" and record.transfer_bytes == (prompt_tokens - 1) * 2048
    # The decode engine computed only the last prompt token, not the prompt.
    assert decode.model.stats.prefix_hits == 0
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1
    assert (
        value(p_metrics, "kvgate_sim_kv_transfer_bytes_total", direction="tx")
        == prompt_tokens * 2048
    )
    assert (
        value(d_metrics, "kvgate_sim_kv_transfer_bytes_total", direction="rx")
        == (prompt_tokens - 1) * 2048
    )
    assert decode.kv_pull_failures == 0


async def test_vllm_decode_without_reachable_prefill_recomputes() -> None:
    async with SimCluster(1, test_profile(), roles=["decode"]) as cluster:
        decode = cluster.engines[0]
        gone = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_host": "127.0.0.1",
            "remote_port": decode.port,
            "remote_request_id": "never-prefilled",
            "remote_engine_id": "x",
            "remote_block_ids": [1],
        }
        async with httpx.AsyncClient() as c:
            r = await c.post(
                decode.url + "/v1/chat/completions",
                json=chat_body(PROMPT, max_tokens=3, kv_transfer_params=gone),
            )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert decode.kv_pull_failures == 1
    assert decode.model.stats.kv_rx_bytes == 0


async def test_sglang_bootstrap_parallel_dispatch() -> None:
    prof = test_profile(kv_bytes_per_token=4096)
    async with SimCluster(2, prof, roles=["prefill", "decode"], flavor="sglang") as cluster:
        prefill, decode = cluster.engines
        room = random.Random(1).randint(0, 2**63 - 1)
        body = chat_body(
            PROMPT,
            max_tokens=6,
            ignore_eos=True,
            bootstrap_host=prefill.host,
            bootstrap_port=prefill.port,
            bootstrap_room=room,
        )
        async with httpx.AsyncClient(timeout=10) as c:
            # Decode first: it must wait for the room to be ready on the prefill engine.
            d_task = asyncio.create_task(c.post(decode.url + "/v1/chat/completions", json=body))
            await asyncio.sleep(0.05)
            assert not d_task.done()
            p_resp = await c.post(prefill.url + "/v1/chat/completions", json=body)
            d_resp = await d_task
            d_metrics = await scrape(c, decode.url)
    assert p_resp.status_code == 200 and p_resp.json()["usage"]["completion_tokens"] == 1
    assert d_resp.status_code == 200 and d_resp.json()["usage"]["completion_tokens"] == 6
    prompt_tokens = d_resp.json()["usage"]["prompt_tokens"]
    assert prefill.blocks_in_use == 0 and decode.blocks_in_use == 0
    assert room not in prefill.rooms
    assert decode.request_log[-1].pd == "decode" and prefill.request_log[-1].pd == "prefill"
    assert prefill.model.stats.kv_tx_bytes == prompt_tokens * 4096
    assert (
        value(d_metrics, "kvgate_sim_kv_transfer_bytes_total", direction="rx")
        == (prompt_tokens - 1) * 4096
    )


async def test_sglang_bootstrap_timeout_is_an_error() -> None:
    async with SimCluster(
        2, test_profile(), roles=["prefill", "decode"], bootstrap_timeout_s=0.2
    ) as cluster:
        prefill, decode = cluster.engines
        body = chat_body(
            PROMPT,
            max_tokens=3,
            bootstrap_host=prefill.host,
            bootstrap_port=prefill.port,
            bootstrap_room=42,
        )
        async with httpx.AsyncClient() as c:
            r = await c.post(decode.url + "/v1/chat/completions", json=body)
    assert r.status_code == 500
    assert "bootstrap" in r.json()["error"]["message"]
    assert decode.blocks_in_use == 0 and decode.kv_pull_failures == 1


async def test_roles_serve_plain_requests_too() -> None:
    async with (
        SimCluster(2, test_profile(), roles=["prefill", "decode"]) as cluster,
        httpx.AsyncClient() as c,
    ):
        for url in cluster.urls:
            r = await c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
