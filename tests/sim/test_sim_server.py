"""The simulated engine over real HTTP (uvicorn on loopback), with httpx and the openai SDK."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from sim_helpers import chat_body, eventually, scrape, test_profile, value

from gateway.sim.cluster import SimCluster

LONG = "The quick brown fox jumps over the lazy dog. " * 12  # ~135 tokens


async def test_repeated_prefix_is_reported_cached_via_openai_client() -> None:
    async with (
        SimCluster(1, test_profile()) as cluster,
        openai.AsyncOpenAI(base_url=cluster.urls[0] + "/v1", api_key="x", max_retries=0) as client,
    ):
        msgs = [{"role": "user", "content": LONG}]
        first = await client.chat.completions.create(
            model="kvgate-sim", messages=msgs, max_tokens=4
        )  # type: ignore[arg-type]
        second = await client.chat.completions.create(
            model="kvgate-sim", messages=msgs, max_tokens=4
        )  # type: ignore[arg-type]
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 100
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 4


async def test_streaming_with_include_usage_via_openai_client() -> None:
    async with (
        SimCluster(1, test_profile()) as cluster,
        openai.AsyncOpenAI(base_url=cluster.urls[0] + "/v1", api_key="x", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(
            model="kvgate-sim",
            messages=[{"role": "user", "content": LONG}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 6
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


async def test_output_is_deterministic_given_the_seed() -> None:
    async def answer(seed: int) -> str:
        async with (
            SimCluster(1, test_profile(), seed=seed) as cluster,
            httpx.AsyncClient(base_url=cluster.urls[0]) as c,
        ):
            r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8})
            return str(r.json()["choices"][0]["text"])

    assert await answer(3) == await answer(3)
    assert await answer(3) != await answer(4)


async def test_completions_stream_and_request_id_echo() -> None:
    async with (
        SimCluster(1, test_profile()) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as c,
    ):
        body = {"prompt": LONG, "max_tokens": 3, "stream": True}
        async with c.stream(
            "POST", "/v1/completions", json=body, headers={"X-Request-Id": "req-42"}
        ) as r:
            assert r.headers["x-request-id"] == "req-42"
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in r.aiter_lines() if line]
        r2 = await c.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers={"X-Request-Id": "req-43"},
        )
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert '"object":"text_completion"' in lines[0] and '"id":"cmpl-req-42"' in lines[0]
    assert r2.headers["x-request-id"] == "req-43"
    assert r2.json()["id"] == "cmpl-req-43"


async def test_priority_rejected_with_vllm_400_unless_enabled() -> None:
    body = chat_body("hi", max_tokens=2, priority=3)
    async with (
        SimCluster(1, test_profile()) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as c,
    ):
        r = await c.post("/v1/chat/completions", json=body)
        ok = await c.post("/v1/chat/completions", json=chat_body("hi", max_tokens=2, priority=0))
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": "Got priority 3 but Priority scheduling is not enabled.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    assert ok.status_code == 200
    async with (
        SimCluster(1, test_profile(), priority_scheduling=True) as cluster,
        openai.AsyncOpenAI(base_url=cluster.urls[0] + "/v1", api_key="x", max_retries=0) as client,
    ):
        resp = await client.chat.completions.create(
            model="kvgate-sim",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"priority": 3},
        )
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/chat/completions", chat_body("hi") | {"model": "other"}, 404, "does not exist"),
        ("/v1/chat/completions", {"model": "kvgate-sim"}, 400, "messages"),
        ("/v1/chat/completions", chat_body("hi", max_tokens=0), 400, "max_tokens"),
        (
            "/v1/chat/completions",
            chat_body("hi", stream_options={"include_usage": True}),
            400,
            "stream",
        ),
        ("/v1/chat/completions", chat_body("x" * 8000), 400, "maximum context length"),
        ("/v1/completions", {"prompt": 5}, 400, "prompt"),
        ("/v1/embeddings", {"input": 3}, 400, "input"),
    ],
)
async def test_bad_requests_get_vllm_error_bodies(
    path: str, body: dict[str, object], status: int, fragment: str
) -> None:
    async with (
        SimCluster(1, test_profile()) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as c,
    ):
        r = await c.post(path, json=body)
        bad_json = await c.post(
            path, content=b"{nope", headers={"content-type": "application/json"}
        )
    assert r.status_code == status
    err = r.json()["error"]
    assert fragment in err["message"] and err["code"] == status
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert bad_json.status_code == 400


async def test_models_health_embeddings() -> None:
    async with (
        SimCluster(1, test_profile(), model="m1") as cluster,
        openai.AsyncOpenAI(base_url=cluster.urls[0] + "/v1", api_key="x", max_retries=0) as client,
    ):
        models = await client.models.list()
        emb = await client.embeddings.create(model="m1", input=["a", "b"])
        async with httpx.AsyncClient(base_url=cluster.urls[0]) as c:
            health = await c.get("/health")
    assert [m.id for m in models.data] == ["m1"]
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 32
    assert emb.data[0].embedding != emb.data[1].embedding
    assert health.status_code == 200


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_metrics_move_with_traffic(flavor: str) -> None:
    async with SimCluster(1, test_profile(), flavor=flavor) as cluster:  # type: ignore[arg-type]
        url = cluster.urls[0]
        async with httpx.AsyncClient(base_url=url) as c:
            before = await scrape(c, url)
            for _ in range(2):
                r = await c.post("/v1/chat/completions", json=chat_body(LONG, max_tokens=5))
                assert r.status_code == 200
            after = await scrape(c, url)
    prompt = r.json()["usage"]["prompt_tokens"]
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    if flavor == "vllm":
        assert value(before, "vllm:prompt_tokens_total") == 0
        assert value(after, "vllm:prompt_tokens_total") == 2 * prompt
        assert value(after, "vllm:generation_tokens_total") == 10
        assert value(after, "vllm:prefix_cache_queries_total") == 2 * prompt
        assert value(after, "vllm:prefix_cache_hits_total") == cached > 0
        assert value(after, "vllm:request_success_total", finished_reason="length") == 2
        assert value(after, "vllm:time_to_first_token_seconds_count", engine="0") == 2
        assert value(after, "vllm:inter_token_latency_seconds_count") == 8
        assert value(after, "vllm:e2e_request_latency_seconds_count") == 2
        assert value(after, "vllm:num_requests_running", model_name="kvgate-sim") == 0
        assert value(after, "vllm:kv_cache_usage_perc") == 0
        assert value(after, "vllm:cache_config_info", num_gpu_blocks="64", block_size="16") == 1
    else:
        assert value(after, "sglang:prompt_tokens_total") == 2 * prompt
        assert value(after, "sglang:generation_tokens_total") == 10
        assert value(after, "sglang:cached_tokens_total") == cached
        assert value(after, "sglang:cache_hit_rate") == pytest.approx(cached / (2 * prompt))
        assert value(after, "sglang:num_queue_reqs") == 0
        assert value(after, "sglang:max_total_num_tokens") == 64 * 16
        assert value(after, "sglang:time_to_first_token_seconds_count") == 2
        assert not any(name.startswith("vllm:") for name, _ in after)


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_kv_pressure_queues_and_preempts_visibly(flavor: str) -> None:
    # 16 blocks: each request needs 6 to start and 11 to finish. Two start together, the
    # third waits; the two running ones outgrow the cache while decoding.
    prof = test_profile(num_gpu_blocks=16, decode_base_s=0.004)
    async with SimCluster(1, prof, flavor=flavor) as cluster:  # type: ignore[arg-type]
        url, engine = cluster.urls[0], cluster.engines[0]
        peak_waiting = peak_usage = 0.0
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:

            async def one(i: int) -> httpx.Response:
                body = {"prompt": f"{i}" * 380, "max_tokens": 80, "ignore_eos": True}
                return await c.post("/v1/completions", json=body)

            tasks = [asyncio.create_task(one(i)) for i in range(3)]
            waiting_name = (
                "vllm:num_requests_waiting" if flavor == "vllm" else "sglang:num_queue_reqs"
            )
            usage_name = "vllm:kv_cache_usage_perc" if flavor == "vllm" else "sglang:token_usage"
            while not all(t.done() for t in tasks):
                s = await scrape(c, url)
                peak_waiting = max(peak_waiting, value(s, waiting_name))
                peak_usage = max(peak_usage, value(s, usage_name))
                await asyncio.sleep(0.005)
            results = [t.result() for t in tasks]
            final = await scrape(c, url)
    assert all(r.status_code == 200 for r in results)
    assert all(r.json()["usage"]["completion_tokens"] == 80 for r in results)
    assert peak_waiting >= 1 and peak_usage > 0.5
    assert engine.model.stats.preemptions >= 1
    preempt_name = (
        "vllm:num_preemptions_total" if flavor == "vllm" else "sglang:num_retracted_requests_total"
    )
    assert value(final, preempt_name) == engine.model.stats.preemptions
    assert sum(rec.preemptions for rec in engine.request_log) == engine.model.stats.preemptions
    assert engine.blocks_in_use == 0


async def test_streaming_disconnect_aborts_and_frees_blocks() -> None:
    prof = test_profile(decode_base_s=0.01)
    async with SimCluster(1, prof) as cluster:
        engine, url = cluster.engines[0], cluster.urls[0]
        async with httpx.AsyncClient(base_url=url) as c:
            body = chat_body(LONG, max_tokens=500, stream=True)
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        break
                assert engine.blocks_in_use > 0
        await eventually(lambda: engine.aborted == 1 and engine.blocks_in_use == 0)
        async with httpx.AsyncClient(base_url=url) as c:
            s = await scrape(c, url)
    assert value(s, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(s, "kvgate_sim_client_disconnects_total") == 1
    assert value(s, "vllm:num_requests_running") == 0
    assert engine.request_log[-1].disconnected
    assert engine.request_log[-1].finish_reason == "abort"


async def test_non_streaming_disconnect_aborts_too() -> None:
    prof = test_profile(decode_base_s=0.01)
    async with SimCluster(1, prof) as cluster:
        engine = cluster.engines[0]
        async with httpx.AsyncClient(
            base_url=cluster.urls[0], timeout=httpx.Timeout(5.0, read=0.2)
        ) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/chat/completions", json=chat_body(LONG, max_tokens=500))
        await eventually(lambda: engine.aborted == 1 and engine.blocks_in_use == 0)
        assert engine.model.num_running == 0 and engine.model.num_waiting == 0


async def test_cluster_ports_state_and_explicit_start_stop() -> None:
    cluster = SimCluster(3, test_profile(), roles=["prefill", "decode"])
    await cluster.start()
    try:
        ports = [e.port for e in cluster.engines]
        assert len(set(ports)) == 3
        assert [r.value for r in cluster.roles()] == ["prefill", "decode", "decode"]
        async with httpx.AsyncClient() as c:
            state = (await c.get(cluster.urls[1] + "/sim/state")).json()
        assert state["role"] == "decode" and state["num_gpu_blocks"] == 64
    finally:
        await cluster.stop()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as c:
            await c.get(cluster.urls[0] + "/health")


def _two_free_consecutive_ports() -> int:
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = int(a.getsockname()[1])
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise RuntimeError("no two consecutive free ports")


async def test_consecutive_base_port() -> None:
    base = _two_free_consecutive_ports()
    async with SimCluster(2, test_profile(), base_port=base) as cluster:
        assert [e.port for e in cluster.engines] == [base, base + 1]


async def test_instant_profile_answers_immediately() -> None:
    async with (
        SimCluster(1, "instant") as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as c,
    ):
        r = await c.post(
            "/v1/chat/completions",
            json=chat_body(LONG, max_tokens=50, stream=True, ignore_eos=True),
        )
        body = r.text
        again = await c.post("/v1/chat/completions", json=chat_body(LONG, max_tokens=5))
    assert body.count("data: ") == 50 + 2  # role chunk + 50 tokens + [DONE]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_drop_cache_takes_the_cache_away_while_requests_run() -> None:
    async with SimCluster(1, test_profile(), time_scale=0.5) as cluster:
        url = cluster.urls[0]
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            await c.post("/v1/chat/completions", json=chat_body(LONG, max_tokens=2))
            # A request still decoding holds blocks: the vLLM-like reset refuses, this does not.
            running = asyncio.create_task(
                c.post("/v1/chat/completions", json=chat_body("other " * 40, max_tokens=60))
            )
            await eventually(lambda: cluster.engines[0].model.num_running == 1)
            assert (await c.post("/reset_prefix_cache")).status_code == 400
            before = (await c.get("/sim/state")).json()["cached_blocks"]
            dropped = (await c.post("/sim/drop_cache")).json()["dropped_blocks"]
            assert dropped == before > 0
            assert (await c.get("/sim/state")).json()["cached_blocks"] == 0
            assert (await running).status_code == 200
            again = await c.post("/v1/chat/completions", json=chat_body(LONG, max_tokens=2))
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
