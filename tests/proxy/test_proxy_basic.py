"""End to end through real servers: openai client -> gateway -> simulated engines."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway

MODEL = "kvgate-sim"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_chat_non_streaming_names_replica_and_request_id(
    client: openai.AsyncOpenAI, engines: list[SimEngine]
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=user("hello"), max_tokens=4, extra_headers={"X-Request-Id": "my-id-1"}
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    assert raw.headers["x-kvgate-replica"] in {"e0", "e1", "e2"}
    assert raw.headers["x-request-id"] == "my-id-1"
    # The engine saw the same request id (it echoes it in its response id).
    assert "my-id-1" in completion.id
    generated = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=user("x"), max_tokens=1
    )
    assert len(generated.headers["x-request-id"]) >= 16


async def test_request_id_rule_on_the_fast_path(gw: RunningGateway) -> None:
    body = {"model": MODEL, "messages": user("ids"), "max_tokens": 1}
    async with httpx.AsyncClient(base_url=gw.url) as http:
        # A usable client id: forwarded to the engine (its response id embeds it), returned once.
        ok = await http.post("/v1/chat/completions", json=body, headers={"x-request-id": "rid-ok"})
        assert ok.headers.get_list("x-request-id") == ["rid-ok"] and "rid-ok" in ok.json()["id"]
        # Too long: replaced by a fresh id, and the engine sees the replacement, not the original.
        long = await http.post(
            "/v1/chat/completions", json=body, headers={"x-request-id": "x" * 500}
        )
        (rid,) = long.headers.get_list("x-request-id")
        assert rid != "x" * 500 and 16 <= len(rid) <= 128 and rid in long.json()["id"]
        # Minted ids differ per request; gateway-made errors carry one too.
        again = await http.post("/v1/chat/completions", json=body)
        bad = await http.post(
            "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
        )
        ids = {rid, again.headers["x-request-id"], bad.headers["x-request-id"]}
        assert len(ids) == 3 and bad.status_code == 400


async def test_chat_streaming_passes_chunks_and_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=user("stream please"),
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(pieces) >= 2
    assert usage is not None and usage.completion_tokens == 6


async def test_completions_and_embeddings(client: openai.AsyncOpenAI) -> None:
    completion = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
    assert completion.choices[0].text
    stream = await client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=3, stream=True
    )
    texts = [c.choices[0].text async for c in stream if c.choices]
    assert texts
    emb = await client.embeddings.create(model=MODEL, input=["a", "b"])
    assert len(emb.data) == 2 and emb.data[0].embedding


async def test_session_header_is_sticky_and_sessions_spread(client: openai.AsyncOpenAI) -> None:
    async def served(session: str) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=user(f"q {session}"),
            max_tokens=1,
            extra_headers={"X-Session-Id": session},
        )
        return raw.headers["x-kvgate-replica"]

    for session in ("alpha", "beta"):
        assert len({await served(session) for _ in range(5)}) == 1
    assert len({await served(f"s{i}") for i in range(30)}) == 3


async def test_conversation_turns_stay_on_one_replica(client: openai.AsyncOpenAI) -> None:
    system = {"role": "system", "content": "You are terse."}
    messages: list[dict[str, str]] = [system, {"role": "user", "content": "first question"}]
    replicas = set()
    for turn in range(4):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=2
        )
        replicas.add(raw.headers["x-kvgate-replica"])
        messages = messages + [
            {"role": "assistant", "content": raw.parse().choices[0].message.content or ""},
            {"role": "user", "content": f"follow-up {turn}"},
        ]
    assert len(replicas) == 1


async def test_models_health_ready_metrics(client: openai.AsyncOpenAI, gw: RunningGateway) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.chat.completions.create(model=MODEL, messages=user("m"), max_tokens=1)
    async with httpx.AsyncClient(base_url=gw.url) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        ready = await http.get("/ready")
        assert ready.status_code == 200 and ready.json()["healthy_replicas"] == 3
        text = (await http.get("/metrics")).text
        assert 'kvgate_requests_total{endpoint="chat",replica="' in text
        assert (
            "kvgate_request_duration_seconds_bucket" in text and "kvgate_ttfb_seconds_count" in text
        )
        assert 'kvgate_routing_decisions_total{policy="lineage",reason="least_cost"}' in text
        assert 'kvgate_in_flight{replica="e0"} 0.0' in text
        assert 'kvgate_replica_healthy{replica="e1"} 1.0' in text
        missing = await http.get("/v1/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        wrong = await http.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


async def test_upstream_status_and_error_body_pass_through(client: openai.AsyncOpenAI) -> None:
    # The engine rejects a non-zero priority (no priority scheduling): a 400 from upstream.
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, messages=user("p"), extra_body={"priority": 5}
        )
    assert "Priority scheduling" in str(info.value)


@pytest.mark.parametrize("client_kind", ["h1", "aiohttp", "httpx"])
async def test_query_string_reaches_the_engine(engines: list[SimEngine], client_kind: str) -> None:
    # Azure-style SDK set-ups add `?api-version=...` to every call; a proxy must not eat it.
    async with gateway(engines, upstream={"client": client_kind}) as gw:
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1",
            api_key="k",
            max_retries=0,
            default_query={"api-version": "2024-10-21"},
        ) as client:
            await client.chat.completions.create(
                model=MODEL, messages=user("q"), max_tokens=1, extra_query={"note": "a b/c"}
            )
            stream = await client.completions.create(
                model=MODEL, prompt="q", max_tokens=2, stream=True
            )
            async for _ in stream:
                pass
        async with httpx.AsyncClient(base_url=gw.url) as http:
            plain = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": user("p"), "max_tokens": 1},
            )
            assert plain.status_code == 200
    records = [r for e in engines for r in e.request_log]
    assert len(records) == 3
    queries = sorted(r.query for r in records)
    assert queries == sorted(
        ["api-version=2024-10-21&note=a+b%2Fc", "api-version=2024-10-21", ""]
    ), queries
