"""The tokenizer stage in worker processes (gateway.kvevents.workers, gateway.kvevents.worker):
the same answers as in a thread, failures that stay contained, and which kind runs where.
(A conversation tokenized turn by turn in a worker, through a gateway:
test_kv_incremental.)"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.errors import ConfigError
from gateway.keys import route_request
from gateway.kvevents.config import TokenizerSettings
from gateway.kvevents.install import KVEventsFeature
from gateway.kvevents.render import SimRenderer
from gateway.kvevents.workers import ProcessJobs, run_job
from gateway.sim.server import KVEventsOptions
from gateway.testing.servers import gateway, sim_engines
from gateway.types import Endpoint
from tests.kvevents.test_kv_incremental import CHATML, bpe_path, text  # noqa: F401
from tests.kvevents.test_kv_routing import MODEL, sources, until


def body(seed: int, words: int = 900) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": text(rng, words)},
            {"role": "user", "content": text(rng, words // 3)},
        ],
    }


async def test_a_worker_process_answers_as_a_thread_does() -> None:
    jobs = ProcessJobs(TokenizerSettings(kind="sim"), block_size=16)
    await jobs.start()
    try:
        for seed in range(3):
            b = body(seed)
            hashes = route_request(
                b, Endpoint.CHAT, "q", block_tokens=64, max_prefix_blocks=4096
            ).prefix_hashes
            got = await jobs.submit(seed, b, Endpoint.CHAT, hashes, 256)
            want = run_job(SimRenderer(None, 16), None, b, Endpoint.CHAT, hashes, 256, 16)
            assert got[0] is not None and want[0] is not None
            assert got[0][0] == want[0][0]  # prompt hashes
            assert list(got[0][1]) == list(want[0][1])  # token-block keys
            assert got[0][2] == want[0][2]  # blocks known at each prompt block
            assert got[4] is not None and got[4].entries == seed + 1  # the worker's cache
    finally:
        await jobs.stop()


async def test_a_worker_that_cannot_load_its_tokenizer_fails_start_up(tmp_path: Path) -> None:
    settings = TokenizerSettings(kind="hf", path=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="tokenizer worker did not start"):
        await ProcessJobs(settings, block_size=16).start()


async def test_a_dead_worker_fails_its_jobs_and_is_started_again() -> None:
    async with (
        sim_engines(2, "instant", kv_events=KVEventsOptions()) as engines,
        gateway(
            engines,
            kv_events={
                "enabled": True,
                "sources": sources(engines),
                "tokenizer": {"kind": "sim", "executor": "process", "route_budget_ms": 200},
            },
        ) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        feature: KVEventsFeature = gw.state.extras["kv_events"]
        processes = feature.stage.processes
        assert processes is not None
        first = processes._procs[0].proc
        first.kill()
        await first.wait()
        for seed in range(3):  # while no worker runs: answered, routed without the events
            r = await http.post("/v1/chat/completions", json={**body(seed), "max_tokens": 4})
            assert r.status_code == 200, r.text
        await until(lambda: feature.stage.pending == 0)
        assert feature.stage.waiting == 0
        failed = (await http.get("/metrics")).text
        await until(lambda: processes.restarts == 1)
        assert processes._procs[0].proc.pid != first.pid
        r = await http.post("/v1/chat/completions", json={**body(7), "max_tokens": 4})
        assert r.status_code == 200, r.text
        await until(lambda: feature.stage.pending == 0)
        page = (await http.get("/metrics")).text
    assert 'kvgate_kv_tokenize_jobs_total{outcome="error"} 3.0' in failed
    assert 'kvgate_kv_tokenize_jobs_total{outcome="done"} 1.0' in page
    assert "kvgate_kv_tokenizer_restarts_total 1.0" in page


async def test_an_hf_tokenizer_runs_in_a_process_and_sim_in_a_thread(
    tmp_path: Path,
    bpe_path: str,  # noqa: F811 - the fixture, imported
) -> None:
    pytest.importorskip("jinja2")
    path = bpe_path
    template = tmp_path / "template.jinja"
    template.write_text(CHATML)
    for kind, in_process in (("hf", True), ("sim", False)):
        tokenizer: dict[str, Any] = {"kind": kind}
        if kind == "hf":
            tokenizer.update(path=str(path), chat_template=str(template))
        async with (
            sim_engines(1, "instant", kv_events=KVEventsOptions()) as engines,
            gateway(
                engines,
                kv_events={"enabled": True, "sources": sources(engines), "tokenizer": tokenizer},
            ) as gw,
            httpx.AsyncClient(base_url=gw.url) as http,
        ):
            feature: KVEventsFeature = gw.state.extras["kv_events"]
            assert (feature.stage.processes is not None) is in_process, kind
            r = await http.post("/v1/chat/completions", json={**body(9), "max_tokens": 4})
            assert r.status_code == 200, r.text
            stage = feature.stage
            await until(lambda: stage.pending == 0)  # noqa: B023 - awaited in this iteration
            assert len(feature.bridge) >= 1, kind
