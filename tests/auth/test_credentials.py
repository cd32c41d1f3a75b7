"""One rule for credentials: no client credential header reaches an engine, on any route; the
engine gets the gateway's own key. The simulated engines record the headers they receive."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import pytest

from gateway.auth.principal import hash_key
from gateway.sim.server import SimEngine
from gateway.testing.forms import CONTENT_TYPE, form
from gateway.testing.servers import RunningGateway, gateway, sim_engines
from gateway.types import UPSTREAM_PATHS

MODEL = "kvgate-sim"
ENGINE_KEY = "engine-secret"
CLIENT_KEY = "sk-alice"
KEYS = [{"name": "alice", "key_sha256": hash_key(CLIENT_KEY)}]
# Every header the gateway knows to carry a credential, plus one the operator configured.
CREDENTIALS = ("authorization", "x-api-key", "api-key", "x-goog-api-key")

ROUTES: list[tuple[str, dict[str, Any] | None]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
    ("/v1/rerank", {"query": "kv", "documents": ["a", "b"]}),
    ("/v1/score", {"text_1": "kv", "text_2": ["a"]}),
    ("/v1/classify", {"input": ["good"]}),
    ("/pooling", {"input": "hi"}),
    ("/v1/audio/speech", {"input": "hello", "voice": "alloy"}),
    ("/v1/audio/transcriptions", None),
    ("/v1/audio/translations", None),
]


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(1, "instant", api_key=ENGINE_KEY) as engines:
        yield engines


@pytest.fixture
async def gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    async with gateway(
        engines,
        auth={"keys": KEYS, "credential_headers": ["X-Goog-Api-Key"]},
        upstream={"engine_api_key": ENGINE_KEY},
        models={"discover": False},
        replicas=[{"id": "e0", "url": engines[0].url, "models": [MODEL]}],
    ) as gw:
        yield gw


def forwarded(engine: SimEngine, path: str) -> dict[str, str]:
    seen = [headers for _, p, headers in engine.received if p == path]
    assert seen, f"the engine never received {path}"
    return seen[-1]


def assert_only_engine_key(headers: dict[str, str]) -> None:
    assert headers.get("authorization") == f"Bearer {ENGINE_KEY}"
    for name in CREDENTIALS[1:]:
        assert name not in headers, name
    assert CLIENT_KEY not in " ".join(headers.values())


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[r[0] for r in ROUTES])
@pytest.mark.parametrize("carrier", ["authorization", "x-api-key", "api-key"])
async def test_no_client_credential_reaches_the_engine(
    gw: RunningGateway,
    engines: list[SimEngine],
    path: str,
    body: dict[str, Any] | None,
    carrier: str,
) -> None:
    # The key in one header (first: the front door reads the first it finds), the others
    # filled with things that must not go on either.
    headers = {carrier: f"Bearer {CLIENT_KEY}" if carrier == "authorization" else CLIENT_KEY}
    headers |= {name: f"Bearer {CLIENT_KEY}-{name}" for name in CREDENTIALS if name != carrier}
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        if body is None:
            content = form({"model": MODEL}, b"RIFF" + b"\0" * 64)
            resp = await http.post(
                path, content=content, headers={**headers, "content-type": CONTENT_TYPE}
            )
        else:
            resp = await http.post(path, json={"model": MODEL, **body}, headers=headers)
    assert resp.status_code == 200, resp.text
    # Some routes reach the engine at its own path (vLLM serves classify at /classify).
    assert_only_engine_key(forwarded(engines[0], UPSTREAM_PATHS.get(path, path)))


async def test_the_anthropic_client_key_stays_at_the_gateway(
    gw: RunningGateway, engines: list[SimEngine]
) -> None:
    # The Anthropic SDK sends its key as x-api-key by default.
    async with anthropic.AsyncAnthropic(
        base_url=gw.url, api_key=CLIENT_KEY, max_retries=0
    ) as client:
        message = await client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hello"}]
        )
        assert message.content
        async with client.messages.stream(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hello"}]
        ) as stream:
            await stream.get_final_message()
    sent = [h for _, p, h in engines[0].received if p == "/v1/messages"]
    assert len(sent) == 2
    for headers in sent:
        assert_only_engine_key(headers)
        assert headers.get("anthropic-version")  # other headers still go along


async def test_stored_response_routes_carry_the_engine_key_only(
    gw: RunningGateway, engines: list[SimEngine]
) -> None:
    auth = {"x-api-key": CLIENT_KEY, "api-key": "other"}
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        made = await http.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "store": True}, headers=auth
        )
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        got = await http.get(f"/v1/responses/{rid}", headers=auth)
        assert got.status_code == 200, got.text
    assert_only_engine_key(forwarded(engines[0], f"/v1/responses/{rid}"))


async def test_keys_off_the_client_authorization_may_pass_but_no_other_credential() -> None:
    async with sim_engines(1, "instant") as engines, gateway(engines) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            resp = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                headers={"authorization": "Bearer mine", "x-api-key": "k", "api-key": "k"},
            )
        assert resp.status_code == 200
        headers = forwarded(engines[0], "/v1/chat/completions")
        assert headers["authorization"] == "Bearer mine"
        assert "x-api-key" not in headers and "api-key" not in headers
