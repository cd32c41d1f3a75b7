"""`kvgate doctor` against the project's simulated engines, each set up to show one finding."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from gateway.app import build_app
from gateway.doctor.checks import Diagnosis, diagnose
from gateway.doctor.cli import collect
from gateway.doctor.findings import Hints
from gateway.plan.cards import get_card
from gateway.plan.catalogue import get_model
from gateway.plan.memory import EngineSettings, budget
from gateway.serving import start_server
from gateway.settings import ReplicaSettings, load_settings
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import get_profile

TINY = get_profile("tiny")  # 64 blocks x 16 = 1,024 KV tokens, max_num_seqs 8


def body(text: str, max_tokens: int) -> dict[str, object]:
    return {"model": "kvgate-sim", "prompt": text, "max_tokens": max_tokens, "ignore_eos": True}


async def doctor(
    urls: list[str],
    hints: Hints | None = None,
    *,
    gateway: str | None = None,
    samples: int = 2,
    interval: float = 0.05,
) -> Diagnosis:
    series, view = await collect(urls, gateway, samples=samples, interval=interval, timeout=5.0)
    return diagnose(series, view, hints or Hints())


def codes(d: Diagnosis) -> set[str]:
    return {f.code for f in d.findings}


@contextlib.asynccontextmanager
async def load(
    url: str, n: int, text: str, max_tokens: int, every_s: float = 0.0
) -> AsyncIterator[list[asyncio.Task[httpx.Response]]]:
    """`n` requests in flight on one engine (one every `every_s`), cancelled on exit."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        tasks: list[asyncio.Task[httpx.Response]] = []

        async def feed() -> None:
            for i in range(n):
                tasks.append(
                    asyncio.create_task(
                        client.post("/v1/completions", json=body(f"r{i} {text}", max_tokens))
                    )
                )
                if every_s:
                    await asyncio.sleep(every_s)

        feeder = asyncio.create_task(feed())
        try:
            if not every_s:
                await feeder
            yield tasks
        finally:
            # Cancelled requests disconnect: the engine aborts them, no need to wait.
            feeder.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(feeder, *tasks, return_exceptions=True)


async def test_healthy_cluster_has_no_findings() -> None:
    async with SimCluster(2, "h200-sparse", time_scale=5.0) as sim:
        for url in sim.urls:
            async with load(url, 3, "hello " * 50, 8) as sent:
                await asyncio.gather(*sent)
        d = await doctor(sim.urls, samples=3)
        assert d.findings == () and not d.severe
        snap = d.engines[sim.urls[0]]
        assert snap.num_gpu_blocks == 40000 and snap.block_size == 16
        assert snap.max_model_len == 131072 and snap.gpu_memory_utilization == 0.9
        assert snap.counters["requests"] == 3 and snap.counters["preemptions"] == 0


async def test_kv_starved_names_the_arithmetic_and_the_fix() -> None:
    async with SimCluster(1, TINY) as sim:
        d = await doctor(sim.urls, samples=1)
        (f,) = d.findings
        assert (f.code, f.severity) == ("kv_starved", "warning")
        assert "64 blocks x 16 = 1,024 tokens" in f.evidence[0]
        assert "1,024 // 1,024 = 1 full-length" in f.evidence[1]
        assert "max_model_len <= 512" in f.suggestion
        # An engine started with a max_model_len its KV cannot hold even once: severe.
        worse = await doctor(sim.urls, Hints(max_model_len=4096, max_num_seqs=8), samples=1)
        (g,) = worse.findings
        assert g.severity == "severe" and "1,024 // 4,096 = 0" in g.evidence[1]
        assert "max_num_seqs 8 (--max-num-seqs) x max_model_len would need 32,768" in g.evidence[2]


async def test_preemptions_while_kv_is_full_are_severe() -> None:
    # 8 sequences of ~200 tokens growing by 700 need ~7,000 tokens of a 1,024-token cache,
    # so preempting lasts far longer than a diagnosis. On a loaded machine one window can still
    # fall between two engine steps: diagnose again (the load goes on) until a window saw one.
    async with SimCluster(1, TINY, time_scale=0.5) as sim:
        async with load(sim.urls[0], 16, "x" * 800, 700):
            for _ in range(10):
                d = await doctor(sim.urls, samples=4, interval=0.3)
                if d.severe:
                    break
        pre = [f for f in d.findings if f.code == "preemptions"]
        assert pre and pre[0].severe and d.severe
        assert "since start" in pre[0].evidence[0] and "in the last" in pre[0].evidence[0]
        assert "max_num_seqs ~" in pre[0].suggestion


async def test_waiting_queue_growing_while_kv_full() -> None:
    slow = TINY.scaled(max_num_seqs=4)
    async with SimCluster(1, slow, time_scale=0.25) as sim:
        async with load(sim.urls[0], 40, "y" * 800, 200, every_s=0.03):
            await asyncio.sleep(0.2)
            d = await doctor(sim.urls, samples=3, interval=0.25)
        grow = [f for f in d.findings if f.code == "queue_growing_kv_full"]
        assert grow, d.findings
        assert "->" in grow[0].evidence[0] and "KV, not max_num_seqs" in grow[0].evidence[1]


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_queue_for_compute_in_arrival_order(flavor: str) -> None:
    """Long prompts queue with the KV nearly empty: prefill is the limit, and the engine
    takes them first come. Said as such unless the engine runs priority scheduling."""
    busy = get_profile("h200-sparse").scaled(max_num_seqs=2)
    for priority in (False, True):
        async with (
            SimCluster(1, busy, time_scale=0.2, flavor=flavor, priority_scheduling=priority) as sim,
            load(sim.urls[0], 12, "z" * 8000, 50, every_s=0.02),
        ):
            await asyncio.sleep(0.3)
            d = await doctor(sim.urls, samples=3, interval=0.2)
            told = await doctor(sim.urls, Hints(priority_scheduling=True), samples=2)
        found = [f for f in d.findings if f.code == "queue_first_come"]
        assert "queue_first_come" not in codes(told)
        if priority and flavor == "sglang":
            assert not found, found  # SGLang's server_info says it schedules by priority
            continue
        assert found, d.findings
        assert "queued in 3 of 3 reads" in found[0].evidence[0]
        assert "--scheduling-policy priority" in found[0].suggestion
        how = found[0].evidence[1]
        if flavor == "sglang":
            assert "enable_priority_scheduling false" in how
        else:
            assert "vLLM does not report" in how


async def test_max_num_batched_tokens_from_sglang_server_info() -> None:
    big = TINY.scaled(max_num_batched_tokens=1024, max_model_len=512)
    async with SimCluster(1, big, flavor="sglang") as sim:
        d = await doctor(sim.urls, samples=1)
        (f,) = [f for f in d.findings if f.code == "max_num_batched_tokens_high"]
        assert "1,024 (server_info chunked_prefill_size) vs KV capacity 1,024" in f.evidence[0]
        assert "set max_num_batched_tokens 256" in f.suggestion  # a power of two <= 1024 / 4
        assert d.engines[sim.urls[0]].server_args["max_running_requests"] == 8


async def test_max_num_batched_tokens_with_the_planned_budget() -> None:
    b = budget(get_model("llama-3.1-8b"), get_card("l40s"), EngineSettings())
    async with SimCluster(1, "h200-sparse") as sim:  # 640,000 KV tokens
        d = await doctor(sim.urls, Hints(max_num_batched_tokens=500_000, budget=b), samples=1)
        (f,) = d.findings
        assert f.code == "max_num_batched_tokens_high"
        # activations: 2 bytes x 69,632 per token x (500,000 - 16,384 tokens)
        freed = 2 * (4 * 4096 + 80 * 128 + 3 * 14336) * (500_000 - 16_384)
        assert f"{freed / 2**30:.2f} GiB = {freed // 131_072:,} more KV tokens" in f.evidence[1]
        assert "set max_num_batched_tokens 16,384" in f.suggestion


async def test_one_hot_replica() -> None:
    async with SimCluster(3, "h200-sparse", time_scale=0.2) as sim:
        async with load(sim.urls[0], 12, "z" * 400, 400):
            await asyncio.sleep(0.1)
            d = await doctor(sim.urls, samples=1)
        (f,) = [f for f in d.findings if f.code == "hot_replica"]
        assert f.replica == sim.urls[0]
        assert "12 here vs a mean of 0.0" in f.evidence[1]


async def test_unreachable_engine_is_severe() -> None:
    async with SimCluster(1, "instant") as sim:
        url = sim.urls[0]
    d = await doctor([url], samples=1)
    (f,) = d.findings
    assert f.code == "unreachable" and f.severe


async def test_stale_and_low_hit_rate_from_the_gateways_view() -> None:
    # Conversations that outgrow a 1,024-token cache: the gateway keeps each on its replica
    # (sticky), the engines evict what it kept together.
    async with SimCluster(2, TINY, time_scale=4.0) as sim:
        settings = load_settings(
            replicas=[{"url": u} for u in sim.urls],
            # One rate for busy and idle engines: the stopped engine's failed read comes
            # within the test's wait.
            scrape={"interval_s": 0.05, "idle_interval_s": 0.05, "stale_after_s": 1.0},
        )
        app = build_app(settings)
        server = await start_server(app)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                history = ["" for _ in range(6)]
                for turn in range(5):
                    for c in range(len(history)):
                        history[c] += f"conversation {c} turn {turn} " + "w" * 600
                        r = await client.post(
                            "/v1/chat/completions",
                            json={
                                "model": "kvgate-sim",
                                "max_tokens": 2,
                                "messages": [{"role": "user", "content": history[c]}],
                            },
                        )
                        assert r.status_code == 200
            d = await doctor(sim.urls, gateway=server.url, samples=1)
            low = [f for f in d.findings if f.code == "hit_rate_low"]
            assert low, d.findings
            assert "went to the replica holding their prefix" in low[0].evidence[0]
            assert "sticky 24" in low[0].evidence[0]
            assert not [f for f in d.findings if f.code == "stale_metrics"]
            # The gateway's (opaque) id for that replica.
            gone = ReplicaSettings(url=sim.urls[1]).id
            await sim.engines[1].stop()
            await asyncio.sleep(1.2)
            d2 = await doctor(sim.urls[:1], Hints(stale_after_s=1.0), gateway=server.url, samples=1)
            stale = [f for f in d2.findings if f.code == "stale_metrics"]
            assert [f.replica for f in stale] == [gone]
            assert "kvgate_scrape_errors_total" in stale[0].evidence[1]
        finally:
            await server.stop()


@pytest.mark.parametrize("healthy", [True, False])
async def test_cli_exit_status_and_json(healthy: bool) -> None:
    profile = get_profile("h200-sparse") if healthy else TINY
    async with SimCluster(1, profile) as sim:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        args = [
            sys.executable,
            "-m",
            "gateway.cli",
            "doctor",
            *sim.urls,
            "--samples",
            "1",
            "--json",
        ]
        if not healthy:
            args += ["--max-model-len", "4096"]
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
        )
        out, err = await proc.communicate()
        report = orjson.loads(out)
        assert proc.returncode == (0 if healthy else 1), err
        assert report["severe"] is (not healthy)
        assert [f["code"] for f in report["findings"]] == ([] if healthy else ["kv_starved"])
        assert report["engines"][sim.urls[0]]["kind"] == "vllm"


async def test_cli_rejects_no_urls() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        "doctor",
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2 and b"at least one engine URL" in err
