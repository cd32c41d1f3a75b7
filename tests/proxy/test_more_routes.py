"""The rest of vLLM's surface through the gateway, with the official openai client where it
has a method (models.retrieve, audio) and its generic `post` where it has none (tokenize,
rerank, score, classify, pooling): answers, errors in OpenAI's shape, clean 404s."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, sim_engines

MODEL = "kvgate-sim"


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(2, "instant") as engines:
        yield engines


@pytest.fixture
async def root(gw: RunningGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    """A client on the server root, for vLLM's unversioned paths (/tokenize, /pooling)."""
    async with openai.AsyncOpenAI(base_url=gw.url, api_key="k", max_retries=0) as client:
        yield client


async def _post(client: openai.AsyncOpenAI, path: str, body: dict[str, Any]) -> Any:
    response = await client.post(path, body=body, cast_to=httpx.Response)
    assert response.status_code == 200 and response.headers["x-kvgate-replica"]
    return response.json()


async def test_models_retrieve(client: openai.AsyncOpenAI) -> None:
    model = await client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        await client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"


async def test_tokenize_and_detokenize_round_trip(root: openai.AsyncOpenAI) -> None:
    tokens = await _post(root, "/tokenize", {"model": MODEL, "prompt": "hello world!"})
    assert tokens["count"] == len(tokens["tokens"]) == 3 and tokens["max_model_len"] > 0
    text = await _post(root, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert text == {"prompt": "hello world!"}
    chat = await _post(
        root, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat["count"] > 1
    with pytest.raises(openai.BadRequestError) as info:
        await root.post(
            "/detokenize", body={"model": MODEL, "tokens": ["a"]}, cast_to=httpx.Response
        )
    assert info.value.param == "tokens"


async def test_rerank_score_classify_pooling(
    client: openai.AsyncOpenAI, root: openai.AsyncOpenAI
) -> None:
    docs = ["the cache", "a replica", "prefill"]
    ranked = await _post(
        client, "/rerank", {"model": MODEL, "query": "kv", "documents": docs, "top_n": 2}
    )
    scores = [r["relevance_score"] for r in ranked["results"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    scored = await _post(client, "/score", {"model": MODEL, "text_1": "kv", "text_2": docs})
    assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    classified = await _post(client, "/classify", {"model": MODEL, "input": ["good", "bad"]})
    assert [sum(d["probs"]) for d in classified["data"]] == pytest.approx([1.0, 1.0])
    pooled = await _post(root, "/pooling", {"model": MODEL, "input": "vectors"})
    assert pooled["data"][0]["object"] == "pooling" and pooled["data"][0]["data"]
    # vLLM's aliases of the same routes.
    async with httpx.AsyncClient(base_url=str(root.base_url)) as http:
        for path in ("/rerank", "/v2/rerank"):
            r = await http.post(path, json={"model": MODEL, "query": "kv", "documents": docs})
            assert r.status_code == 200 and len(r.json()["results"]) == 3


async def test_bad_bodies_are_openai_errors(client: openai.AsyncOpenAI) -> None:
    cases = [
        ("/rerank", {"model": MODEL, "documents": ["a"]}, "query"),
        ("/score", {"model": MODEL, "text_1": "a"}, "text_1"),
        ("/classify", {"model": MODEL}, "input"),
        ("/rerank", {"model": "", "query": "q", "documents": ["a"]}, "model"),
    ]
    for path, body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await client.post(path, body=body, cast_to=httpx.Response)
        assert info.value.param == param, (path, info.value)
    with pytest.raises(openai.NotFoundError):
        await client.post(
            "/rerank",
            body={"model": "nope", "query": "q", "documents": ["a"]},
            cast_to=httpx.Response,
        )


async def test_unknown_paths_stay_a_clean_404(gw: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        for method, path in (
            ("POST", "/v1/audio/nope"),
            ("POST", "/v1/messages/batches"),
            ("GET", "/v1/nope"),
        ):
            r = await http.request(method, path, json={})
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
        wrong = await http.get("/v1/responses")
        assert wrong.status_code == 405


async def test_speech(client: openai.AsyncOpenAI) -> None:
    audio = await client.audio.speech.create(model=MODEL, voice="alloy", input="hello there")
    assert (
        audio.content.startswith(b"RIFF") and audio.response.headers["content-type"] == "audio/wav"
    )


async def test_transcription_multipart_passes_byte_for_byte(
    client: openai.AsyncOpenAI, engines: list[SimEngine]
) -> None:
    audio = os.urandom(5 * 1024 * 1024)
    text = await client.audio.transcriptions.create(
        model=MODEL, file=("talk.wav", audio, "audio/wav")
    )
    assert text.text == f"simulated transcript of {len(audio)} bytes"
    received = [u for e in engines for u in e.uploads]
    assert received == [(hashlib.sha256(audio).hexdigest(), len(audio))]
    translated = await client.audio.translations.create(
        model=MODEL, file=("t.wav", b"RIFF....", "audio/wav")
    )
    assert "8 bytes" in translated.text


async def test_transcription_errors(gw: RunningGateway, client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.audio.transcriptions.create(model="no-such-model", file=("a.wav", b"x"))
    async with httpx.AsyncClient(base_url=gw.url) as http:
        r = await http.post("/v1/audio/transcriptions", json={"model": MODEL})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
