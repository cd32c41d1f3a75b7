"""Headroom for the top class, end to end: a gateway with a prefill-token budget in front of
a simulated engine running priority scheduling, on loopback.

The engine schedules running requests first, so once low-class prefills fill a step a
top-class request waits behind them whatever its engine `priority`. With the budget, the
low class fills about one prefill chunk of each step and the top class finds room at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx

from gateway.admission.gate import AdmissionGate
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import gateway, replica_config
from gateway.types import ReplicaId

MODEL = "kvgate-sim"
E0 = ReplicaId("e0")
STEP_TOKENS = 256
CHUNK = 128
# A 1500-token prompt prefills in 12 chunks of 128 tokens: ~0.4 s on this profile.
PROFILE = PROFILES["tiny"].scaled(
    prefill_tokens_per_s=4000.0,
    num_gpu_blocks=512,
    max_model_len=4096,
    max_num_batched_tokens=STEP_TOKENS,
    long_prefill_token_threshold=CHUNK,
)


def _admission() -> dict[str, Any]:
    return {
        "enabled": True,
        "classes": [{"name": "interactive"}, {"name": "batch", "holdback": 0.42}],
        "default_class": "batch",
        "saturation": {
            "max_waiting": None,
            "max_kv_usage": None,
            # The top class may fill the step but for a short prefill; batch gets less
            # than one chunk, so a long batch prompt only goes when nothing else prefills.
            "max_prefill_tokens": int(0.85 * STEP_TOKENS),
            "prefill_chunk_tokens": CHUNK,
        },
        "class_head_start_s": 10.0,
        "max_wait_s": 10.0,
        "recheck_interval_s": 0.02,
    }


async def _ttft(http: httpx.AsyncClient, words: int, cls: str, out: dict[str, float]) -> None:
    t0 = time.perf_counter()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{cls} {len(out)} " + "tok " * words}],
        "max_tokens": 2,
        "stream": True,
    }
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Priority": cls}
    ) as r:
        assert r.status_code == 200
        async for _ in r.aiter_bytes():
            out.setdefault(f"{cls}-{words}", time.perf_counter() - t0)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached within 5 s")


async def test_top_class_short_goes_past_running_low_class_long_prefills() -> None:
    engine = SimEngine(PROFILE, index=0, priority_scheduling=True)
    await engine.start()
    try:
        replicas = replica_config([engine], priority_scheduling=True)
        async with (
            gateway([engine], replicas=replicas, admission=_admission()) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
        ):
            gate = gw.state.admission
            assert isinstance(gate, AdmissionGate)
            first: dict[str, float] = {}
            low_a = asyncio.create_task(_ttft(http, 1500, "batch", first))
            await _until(lambda: gate.prefill_tokens_in_flight(E0) > 0)
            # A second long batch prompt would share the step: it waits in the gateway.
            low_b = asyncio.create_task(_ttft(http, 1499, "batch", first))
            await _until(lambda: len(gate.room) == 1)
            high = asyncio.create_task(_ttft(http, 40, "interactive", first))
            await asyncio.wait_for(high, 10)
            assert "batch-1500" not in first  # the long batch prefill is still running
            assert len(gate.room) == 1  # and the second one still waits in the gateway
            await asyncio.wait_for(asyncio.gather(low_a, low_b), 20)
        assert first["interactive-40"] < first["batch-1500"] / 2
        # Class priority x 3 ranks (gateway.admission.engine_order); these prompts rank 0.
        assert {r.priority for r in engine.request_log} == {0, 3}
    finally:
        await engine.stop()
