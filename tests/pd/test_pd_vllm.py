"""vLLM connector protocol end to end: gateway -> prefill sim -> decode sim."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai

from gateway.sim.faults import FaultConfig
from gateway.types import Role

B, P, D = Role.BOTH, Role.PREFILL, Role.DECODE


async def test_handoff_streams_decode_and_relays_kv_params(rig_factory: Any) -> None:
    async with (
        rig_factory([B, P, D]) as rig,
        openai.AsyncOpenAI(base_url=rig.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(
            model="kvgate-sim",
            messages=[{"role": "user", "content": "x " * 4000}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        text = ""
        async for part in stream:
            if part.choices:
                text += part.choices[0].delta.content or ""
        assert text
        await rig.settle()
        (pre,) = rig.records("p0")
        (dec,) = rig.records("d0")
        assert pre.pd == "prefill" and pre.output_tokens == 1
        assert dec.pd == "decode" and dec.output_tokens == 6
        assert pre.request_id == dec.request_id  # same X-Request-Id on both legs
        assert dec.transfer_bytes > 0 and rig.engine("d0").kv_pull_failures == 0
        assert rig.records("c0") == []
        assert rig.engine("p0").model.num_held == 0  # the decoder pulled the KV
        assert rig.metric("kvgate_pd_handoffs_total", protocol="vllm", outcome="served") == 1
        assert (
            rig.metric(
                "kvgate_pd_decisions_total",
                model="kvgate-sim",
                decision="disaggregate",
                reason="mode_always",
            )
            == 1
        )
        assert rig.metric("kvgate_pd_kv_bytes_estimated_total", model="kvgate-sim") > 0


async def test_non_streaming_handoff(rig_factory: Any) -> None:
    async with rig_factory([B, P, D]) as rig:
        resp = await rig.chat()
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvgate-replica"] == "d0"
        assert resp.json()["usage"]["completion_tokens"] == 8
        await rig.settle()


async def test_prefill_error_falls_back_to_colocated(rig_factory: Any) -> None:
    async with rig_factory([B, P, D], faults={1: FaultConfig(error=500)}) as rig:
        resp = await rig.chat(stream=True)
        assert resp.status_code == 200
        assert resp.headers["x-kvgate-replica"] == "c0"
        assert b"[DONE]" in resp.content
        await rig.settle()
        assert rig.records("d0") == []
        assert (
            rig.metric("kvgate_pd_handoffs_total", protocol="vllm", outcome="prefill_failed") == 1
        )


async def test_prefill_timeout_falls_back_to_colocated(rig_factory: Any) -> None:
    async with rig_factory(
        [B, P, D], faults={1: FaultConfig(stall=0)}, prefill_timeout_s=0.3
    ) as rig:
        resp = await rig.chat()
        assert resp.status_code == 200
        assert resp.headers["x-kvgate-replica"] == "c0"
        await rig.settle()
        assert rig.records("d0") == []


async def test_decode_failure_retries_another_decoder(rig_factory: Any) -> None:
    async with rig_factory([B, P, D, D], faults={2: FaultConfig(error=503)}) as rig:
        # Whichever decoder ranks first, the answer comes from the healthy one. Six
        # sessions: their tie-breaks put the failing decoder first for some of them.
        for i in range(6):
            resp = await rig.chat(stream=True, headers={"X-Session-Id": f"s{i}"})
            assert resp.status_code == 200
            assert resp.headers["x-kvgate-replica"] == "d1"
        await rig.settle()
        assert all(r.pd == "decode" and r.transfer_bytes > 0 for r in rig.records("d1"))
        assert rig.engine("d1").kv_pull_failures == 0
        assert rig.records("c0") == []
        assert (
            rig.metric(
                "kvgate_pd_handoffs_total", protocol="vllm", outcome="served_after_decode_retry"
            )
            >= 1
        )


async def test_decode_silent_before_first_byte_is_retried(rig_factory: Any) -> None:
    async with rig_factory(
        [B, P, D, D], faults={2: FaultConfig(stall=0)}, first_token_timeout_s=0.3
    ) as rig:
        for _ in range(2):
            resp = await rig.chat(stream=True)
            assert resp.headers["x-kvgate-replica"] == "d1"
            assert b"[DONE]" in resp.content
        await rig.settle()


async def test_every_decoder_failing_falls_back_to_colocated(rig_factory: Any) -> None:
    faults = {2: FaultConfig(error=500), 3: FaultConfig(error=503)}
    async with rig_factory([B, P, D, D], faults=faults) as rig:
        resp = await rig.chat()
        assert resp.status_code == 200
        assert resp.headers["x-kvgate-replica"] == "c0"
        await rig.settle()
        assert rig.metric("kvgate_pd_handoffs_total", protocol="vllm", outcome="decode_failed") == 1


async def test_client_disconnect_mid_stream_cancels_decode(rig_factory: Any) -> None:
    async with rig_factory([B, P, D]) as rig:
        body = {
            "model": "kvgate-sim",
            "messages": [{"role": "user", "content": "y " * 3000}],
            "max_tokens": 5000,
            "stream": True,
            "ignore_eos": True,
        }
        async with rig.http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.headers["x-kvgate-replica"] == "d0"
            async for _ in resp.aiter_bytes():
                break
        await rig.settle()
        for _ in range(200):
            if rig.engine("d0").aborted:
                break
            await asyncio.sleep(0.01)
        assert rig.engine("d0").aborted == 1
        assert rig.engine("d0").model.num_running == 0


async def test_client_disconnect_during_prefill_cancels_it(rig_factory: Any) -> None:
    async with rig_factory([B, P, D], faults={1: FaultConfig(stall=0)}) as rig:
        # Only the read is short: a loaded machine may take longer than that to connect.
        with_timeout = httpx.Timeout(5.0, read=0.4)
        try:
            await rig.http.post(
                "/v1/chat/completions",
                timeout=with_timeout,
                json={
                    "model": "kvgate-sim",
                    "messages": [{"role": "user", "content": "z " * 3000}],
                    "max_tokens": 4,
                },
            )
        except httpx.ReadTimeout:
            pass
        await rig.settle()
        assert rig.records("d0") == [] and rig.records("c0") == []
        for _ in range(200):
            if rig.engine("p0").aborted:
                break
            await asyncio.sleep(0.01)
        assert rig.engine("p0").aborted == 1


async def test_each_leg_gets_its_own_engine_priority(rig_factory: Any) -> None:
    """With priority-scheduling engines the prefill leg ranks by the prompt it must compute
    and the decode leg, which receives the prompt as KV, ranks as nothing to prefill."""
    async with rig_factory([B, P, D], priority=True) as rig:
        resp = await rig.chat("x " * 20_000)  # about 10K uncached tokens
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvgate-replica"] == "d0"
        await rig.settle()
        (pre,) = rig.records("p0")
        (dec,) = rig.records("d0")
        assert (pre.pd, pre.priority) == ("prefill", 2)
        assert (dec.pd, dec.priority) == ("decode", 0)
