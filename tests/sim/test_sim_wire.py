"""The simulated engine's wire surface over real HTTP: bad bodies answered the way vLLM
answers them (400, `BadRequestError`, the offending field), the prefix cache reported in
`usage`, and the utility routes (tokenize, detokenize, embeddings) consistent with each
other. The gateway's own tests lean on all of it, so a drift here hides gateway bugs."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from gateway.sim.server import SimEngine
from gateway.testing.servers import sim_engines

MODEL = "kvgate-sim"
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    async with sim_engines(1, "instant") as engines:
        yield engines[0]


@pytest.fixture
async def http(engine: SimEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=engine.url, timeout=10) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 2}, "n"),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "max_tokens": True},
            "max_tokens",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stream": "yes"}, "stream"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT, "priority": "high"},
            "priority",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "cache_salt": 3}, "cache_salt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": 7}, "prompt"),
        ("/v1/embeddings", {"model": MODEL, "input": []}, "input"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ],
)
async def test_bad_bodies_are_vllm_shaped_400s(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param and error["message"]


async def test_not_json_is_a_400_too(http: httpx.AsyncClient) -> None:
    r = await http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]


async def test_a_repeated_prompt_is_served_from_the_prefix_cache(engine: SimEngine) -> None:
    long_prompt = [{"role": "user", "content": "a shared document to read twice " * 40}]
    async with openai.AsyncOpenAI(
        base_url=engine.url + "/v1", api_key="k", max_retries=0
    ) as client:
        first = await client.chat.completions.create(
            model=MODEL,
            messages=long_prompt,
            max_tokens=2,  # type: ignore[arg-type]
        )
        second = await client.chat.completions.create(
            model=MODEL,
            messages=long_prompt,
            max_tokens=2,  # type: ignore[arg-type]
        )
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 100
    cold = first.usage.prompt_tokens_details
    warm = second.usage.prompt_tokens_details
    assert cold is not None and warm is not None
    assert (cold.cached_tokens or 0) == 0
    # Whole blocks of the first request's prompt are found again (not the last, partial one).
    assert first.usage.prompt_tokens - 16 <= (warm.cached_tokens or 0) < first.usage.prompt_tokens
    assert second.usage.completion_tokens == 2


async def test_tokenize_counts_what_the_chat_route_counts(http: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "count these words for me"}]
    tokenized = (await http.post("/tokenize", json={"model": MODEL, "messages": messages})).json()
    chat = (
        await http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
        )
    ).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == chat["usage"]["prompt_tokens"]
    assert tokenized["max_model_len"] > 0


async def test_detokenize_inverts_tokenize_for_plain_text(http: httpx.AsyncClient) -> None:
    text = "plain ascii text, tokenized and back"
    tokens = (await http.post("/tokenize", json={"prompt": text})).json()["tokens"]
    back = (await http.post("/detokenize", json={"tokens": tokens})).json()["prompt"]
    assert back == text
    strs = (await http.post("/tokenize", json={"prompt": text, "return_token_strs": True})).json()
    assert "".join(strs["token_strs"]) == text


async def test_embeddings_are_deterministic_unit_vectors(engine: SimEngine) -> None:
    async with openai.AsyncOpenAI(
        base_url=engine.url + "/v1", api_key="k", max_retries=0
    ) as client:
        a = await client.embeddings.create(model=MODEL, input=["alpha", "beta"])
        b = await client.embeddings.create(model=MODEL, input="alpha")
    first, second = a.data[0].embedding, a.data[1].embedding
    assert len(first) == len(second) > 0
    assert math.isclose(sum(v * v for v in first), 1.0, rel_tol=1e-9)
    assert b.data[0].embedding == first  # the same text, the same vector
    assert first != second
    assert a.usage.prompt_tokens >= 2
