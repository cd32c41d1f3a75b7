"""What vLLM 0.33 accepts, the gateway accepts (issue 44, item 9), through the real proxy and
a sim engine: `model` left out when one model is served, `/v1/classify` sent to vLLM's only
`/classify`, score's `data_1`/`data_2` (and the other forms), rerank with a single document
or a content-object query."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from gateway.testing.servers import gateway, replica_config, sim_engines

MODEL = "kvgate-sim"


async def test_a_request_without_model_goes_to_the_one_model_served() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, health={"interval_s": 60}) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        chat = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        emb = await http.post("/v1/embeddings", json={"input": "hi"})
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == MODEL
        assert emb.status_code == 200, emb.text


async def test_without_model_and_several_served_the_client_is_told_why() -> None:
    async with sim_engines(1, "instant") as engines:
        replicas = replica_config(engines, models=[MODEL, "another-model"])
        async with (
            gateway(engines, replicas=replicas, health={"interval_s": 60}) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            resp = await http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "model" and "2 models" in error["message"]


async def test_classify_reaches_the_engine_at_vllms_path() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, health={"interval_s": 60}) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        for path in ("/v1/classify", "/classify"):
            resp = await http.post(path, json={"model": MODEL, "input": "good movie"})
            assert resp.status_code == 200, resp.text
        paths = [r.endpoint for r in engines[0].request_log]
    assert paths == ["/classify", "/classify"]


async def test_score_and_rerank_forms_through_the_openai_client() -> None:
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, health={"interval_s": 60}) as gw,
        openai.AsyncOpenAI(base_url=gw.url, api_key="x", max_retries=0) as client,
    ):
        bodies: list[tuple[str, dict[str, Any]]] = [
            ("/score", {"data_1": "what is a cache", "data_2": ["a store", "a fish"]}),
            ("/v1/score", {"text_1": "q", "text_2": "d"}),
            ("/v1/score", {"queries": "q", "items": ["a", "b"]}),
            ("/v1/rerank", {"query": "q", "documents": "the only document"}),
            (
                "/rerank",
                {"query": {"content": [{"type": "text", "text": "q"}]}, "documents": ["d"]},
            ),
        ]
        for path, body in bodies:
            got = await client.post(path, body={"model": MODEL, **body}, cast_to=httpx.Response)
            assert got.status_code == 200, (path, got.text)
            data = got.json()
            assert data.get("data") or data.get("results"), (path, data)
