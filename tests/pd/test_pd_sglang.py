"""SGLang bootstrap protocol end to end: both legs at once, decode leg streamed."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai

from gateway.sim.faults import FaultConfig
from gateway.types import Role

B, P, D = Role.BOTH, Role.PREFILL, Role.DECODE


async def _eventually(check: Any) -> None:
    for _ in range(300):
        if check():
            return
        await asyncio.sleep(0.01)
    assert check()


async def _stream(rig: Any, max_tokens: int) -> tuple[str, list[Any]]:
    """A streamed chat completion through the official client: (replica, chunks)."""
    async with openai.AsyncOpenAI(base_url=rig.url + "/v1", api_key="x", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="kvgate-sim",
            messages=[{"role": "user", "content": "w " * 4000}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        return raw.headers["x-kvgate-replica"], [c async for c in raw.parse()]


async def test_both_legs_meet_in_one_room(rig_factory: Any) -> None:
    async with rig_factory([B, P, D], protocol="sglang") as rig:
        replica, chunks = await _stream(rig, 7)
        assert replica == "d0"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        await rig.settle()
        (pre,) = rig.records("p0")
        (dec,) = rig.records("d0")
        assert (pre.pd, dec.pd) == ("prefill", "decode")
        assert dec.output_tokens == 7 and not dec.disconnected
        assert rig.engine("d0").kv_pull_failures == 0
        assert rig.engine("p0").model.num_held == 0 and not rig.engine("p0").rooms
        assert rig.records("c0") == []
        assert rig.metric("kvgate_pd_handoffs_total", protocol="sglang", outcome="served") == 1


async def test_prefill_error_cancels_decode_and_falls_back(rig_factory: Any) -> None:
    async with rig_factory([B, P, D], protocol="sglang", faults={1: FaultConfig(error=500)}) as rig:
        resp = await rig.chat(stream=True)
        assert resp.status_code == 200 and b"[DONE]" in resp.content
        assert resp.headers["x-kvgate-replica"] == "c0"
        await rig.settle()
        # The decode leg was waiting for a room that will never open: it was hung up on.
        await _eventually(lambda: all(r.disconnected for r in rig.records("d0")))
        assert all(r.output_tokens == 0 for r in rig.records("d0"))
        assert (
            rig.metric("kvgate_pd_handoffs_total", protocol="sglang", outcome="prefill_failed") == 1
        )


async def test_prefill_timeout_cancels_both(rig_factory: Any) -> None:
    async with rig_factory(
        [B, P, D], protocol="sglang", faults={1: FaultConfig(stall=0)}, prefill_timeout_s=0.3
    ) as rig:
        resp = await rig.chat()
        assert resp.status_code == 200
        assert resp.headers["x-kvgate-replica"] == "c0"
        await rig.settle()
        await _eventually(lambda: all(r.disconnected for r in rig.records("d0")))
        await _eventually(lambda: all(r.disconnected for r in rig.records("p0")))


async def test_decode_failure_is_not_retried_but_falls_back(rig_factory: Any) -> None:
    # The room belongs to the failed decoder: no second decoder, colocated instead.
    async with rig_factory(
        [B, P, D, D],
        protocol="sglang",
        faults={2: FaultConfig(error=500), 3: FaultConfig(error=503)},
    ) as rig:
        for _ in range(2):
            resp = await rig.chat(stream=True)
            assert resp.status_code == 200 and b"[DONE]" in resp.content
            assert resp.headers["x-kvgate-replica"] == "c0"
        await rig.settle()
        # One decode attempt per request (the vllm protocol would have tried both).
        tried = sum(rig.engine(d).faults.injected_errors for d in ("d0", "d1"))
        assert tried == 2
        assert (
            rig.metric("kvgate_pd_handoffs_total", protocol="sglang", outcome="decode_failed") == 2
        )


async def test_client_disconnect_cancels_both_legs(rig_factory: Any) -> None:
    # The prefill never answers, so both legs are still open when the client leaves.
    async with rig_factory([B, P, D], protocol="sglang", faults={1: FaultConfig(stall=0)}) as rig:
        try:
            await rig.http.post(
                "/v1/chat/completions",
                timeout=httpx.Timeout(5.0, read=0.5),  # a slow connect is not the leave
                json={
                    "model": "kvgate-sim",
                    "messages": [{"role": "user", "content": "v " * 3000}],
                    "max_tokens": 4,
                    "stream": True,
                },
            )
        except httpx.ReadTimeout:
            pass
        await rig.settle()
        await _eventually(lambda: [r.disconnected for r in rig.records("p0")] == [True])
        await _eventually(lambda: [r.disconnected for r in rig.records("d0")] == [True])
        assert rig.records("c0") == []


async def test_client_disconnect_mid_stream(rig_factory: Any) -> None:
    async with rig_factory([B, P, D], protocol="sglang") as rig:
        body = {
            "model": "kvgate-sim",
            "messages": [{"role": "user", "content": "u " * 3000}],
            "max_tokens": 5000,
            "stream": True,
            "ignore_eos": True,
        }
        async with rig.http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.headers["x-kvgate-replica"] == "d0"
            async for _ in resp.aiter_bytes():
                break
        await rig.settle()
        await _eventually(lambda: rig.engine("d0").aborted == 1)
        assert rig.engine("d0").model.num_running == 0


async def test_a_failed_prefill_falls_back_at_once_not_when_the_room_times_out(
    rig_factory: Any,
) -> None:
    # The decode leg waits for its room up to the bootstrap timeout; the dispatcher races
    # its first chunk against the prefill leg, so a prefill failure ends the wait at once.
    async with rig_factory(
        [B, P, D], protocol="sglang", faults={1: FaultConfig(error=500)}, bootstrap_timeout_s=30
    ) as rig:
        loop = asyncio.get_running_loop()
        started = loop.time()
        resp = await rig.chat(stream=True)
        took = loop.time() - started
        assert resp.status_code == 200 and b"[DONE]" in resp.content
        assert resp.headers["x-kvgate-replica"] == "c0"
        assert took < 5.0, took
        await rig.settle()


async def test_the_decode_stream_reaches_the_client_whole_and_once(rig_factory: Any) -> None:
    # The first chunk is read by the dispatcher, then replayed: it must arrive once, with
    # every later chunk after it (no second reader, nothing skipped).
    async with rig_factory([B, P, D], protocol="sglang") as rig:
        replica, chunks = await _stream(rig, 12)
        assert replica == "d0"
        roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
        tokens = [c for c in chunks if c.choices and c.choices[0].delta.content]
        assert roles == ["assistant"]
        assert len(tokens) == 12
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
        assert len({c.id for c in chunks}) == 1
        await rig.settle()


async def test_each_leg_gets_its_own_engine_priority(rig_factory: Any) -> None:
    """The two legs share the room but not the priority: the decode leg has no prefill."""
    async with rig_factory([B, P, D], protocol="sglang", priority=True) as rig:
        resp = await rig.chat("x " * 20_000)
        assert resp.status_code == 200, resp.text
        await rig.settle()
        (pre,) = rig.records("p0")
        (dec,) = rig.records("d0")
        assert (pre.pd, pre.priority) == ("prefill", 2)
        assert (dec.pd, dec.priority) == ("decode", 0)
        assert rig.metric("kvgate_pd_handoffs_total", protocol="sglang", outcome="served") == 1
