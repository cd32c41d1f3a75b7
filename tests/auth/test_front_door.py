"""API keys on real servers: openai client -> gateway (keys on) -> simulated engines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from starlette.routing import Route

from gateway.auth.principal import hash_key
from gateway.console.api import console_asset_paths
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines
from gateway.types import error_shape

MODEL = "kvgate-sim"
ENGINE_KEY = "engine-secret"
KEYS: list[dict[str, Any]] = [
    {
        "name": "alice",
        "key_sha256": hash_key("sk-alice"),
        "tenant": "acme",
        "max_priority": "default",
    },
    {"name": "bob", "key_sha256": hash_key("sk-bob"), "models": ["other-model"]},
    {"name": "gone", "key_sha256": hash_key("sk-gone"), "disabled": True},
    {"name": "ops", "key_sha256": hash_key("sk-ops"), "admin": True},
]


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    # The engines demand their own key: a request only succeeds when the gateway sends it.
    async with sim_engines(2, "instant", api_key=ENGINE_KEY) as engines:
        yield engines


@pytest.fixture
async def gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    async with gateway(
        engines,
        auth={"keys": KEYS},
        upstream={"engine_api_key": ENGINE_KEY},
        admission={"enabled": True},
        models={"discover": False},
        replicas=[{"id": f"e{e.index}", "url": e.url, "models": [MODEL]} for e in engines],
    ) as gw:
        yield gw


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **extra,
    }


async def test_a_valid_key_is_served_and_the_engine_gets_the_engine_key(gw: RunningGateway) -> None:
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0
    ) as client:
        out = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert out.choices[0].message.content


@pytest.mark.parametrize(
    ("headers", "status", "code", "words"),
    [
        ({}, 401, "invalid_api_key", "didn't provide an API key"),
        ({"authorization": "Bearer sk-wrong"}, 401, "invalid_api_key", "Incorrect or revoked"),
        ({"authorization": "Bearer sk-gone"}, 401, "invalid_api_key", "Incorrect or revoked"),
        (
            {"authorization": "Bearer sk-alice", "x-priority": "interactive"},
            403,
            "permission_denied",
            "at best",
        ),
        (
            {"authorization": "Bearer sk-alice", "x-tenant-id": "other"},
            403,
            "permission_denied",
            "tenant",
        ),
        ({"authorization": "Bearer sk-bob"}, 403, "permission_denied", "may not use the model"),
    ],
)
async def test_refusals_have_their_status_and_openai_body(
    gw: RunningGateway, headers: dict[str, str], status: int, code: str, words: str
) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        r = await http.post("/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and words in error["message"]
    assert error["type"] in ("authentication_error", "permission_error")
    assert r.headers["x-request-id"]


async def test_the_official_client_raises_its_own_errors(gw: RunningGateway) -> None:
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="sk-wrong", max_retries=0
    ) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0
    ) as client:
        with pytest.raises(openai.PermissionDeniedError):
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=1,
                extra_headers={"x-priority": "interactive"},
            )


async def test_a_key_without_class_gets_its_ceiling_at_best(gw: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        ok = await http.post(
            "/v1/chat/completions",
            json=chat(),
            headers={"authorization": "Bearer sk-alice", "x-priority": "batch"},
        )
        assert ok.status_code == 200


async def test_no_route_but_health_and_ready_answers_without_credentials(
    gw: RunningGateway,
) -> None:
    paths: list[tuple[str, str]] = []
    for route in gw.app.routes:
        assert isinstance(route, Route)
        for method in sorted(route.methods or {"GET"}):
            if method != "HEAD":
                paths.append((method, route.path))
    assert ("GET", "/metrics") in paths and ("POST", "/v1/chat/completions") in paths
    async with httpx.AsyncClient(base_url=gw.url) as http:
        for method, path in paths:
            r = await http.request(method, path, json={} if method == "POST" else None)
            if path in ("/health", "/ready") or path in console_asset_paths("/console"):
                # Probes, and the console's static page (its data is under /admin).
                assert r.status_code == 200, path
            else:
                assert r.status_code == 401, (method, path, r.status_code)
                if error_shape(path) == "anthropic":  # Anthropic's API, Anthropic's error shape
                    assert r.json()["error"]["type"] == "authentication_error"
                else:
                    assert r.json()["error"]["code"] == "invalid_api_key"
        # Unmounted paths too: nothing tells an unauthenticated caller what exists.
        assert (await http.get("/admin/whatever")).status_code == 401


async def test_admin_endpoints_need_an_admin_key(gw: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        user = await http.get("/metrics", headers={"authorization": "Bearer sk-alice"})
        assert user.status_code == 403 and user.json()["error"]["type"] == "permission_error"
        admin = await http.get("/metrics", headers={"authorization": "Bearer sk-ops"})
        assert admin.status_code == 200 and "kvgate_auth_refusals_total" in admin.text
        models = await http.get("/v1/models", headers={"authorization": "Bearer sk-alice"})
        assert models.status_code == 200


async def test_the_console_page_is_open_and_its_data_needs_an_admin_key(gw: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        page = await http.get("/console")
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert (await http.get("/admin/fleet")).status_code == 401
        user = await http.get("/admin/fleet", headers={"authorization": "Bearer sk-alice"})
        assert user.status_code == 403
        admin = await http.get("/admin/fleet", headers={"authorization": "Bearer sk-ops"})
        assert admin.status_code == 200 and admin.json()["replicas"]


async def test_usage_is_exported_per_key_and_tenant(gw: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        for _ in range(2):
            r = await http.post(
                "/v1/chat/completions", json=chat(), headers={"authorization": "Bearer sk-alice"}
            )
            assert r.status_code == 200
        text = (await http.get("/metrics", headers={"authorization": "Bearer sk-ops"})).text
    assert 'kvgate_key_requests_total{key="alice",status="2xx",tenant="acme"} 2.0' in text
    assert 'kvgate_key_tokens_total{key="alice",kind="output",tenant="acme"} 4.0' in text


async def test_keys_off_by_default_and_the_client_authorization_then_passes(
    engines: list[SimEngine],
) -> None:
    # No key configured: the demo stays open, and the client may hold the engines' key.
    replicas = [{"id": f"e{e.index}", "url": e.url, "models": [MODEL]} for e in engines]
    async with (
        gateway(engines, replicas=replicas, models={"discover": False}) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        ok = await http.post(
            "/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {ENGINE_KEY}"}
        )
        refused = await http.post(
            "/v1/chat/completions", json=chat(), headers={"authorization": "Bearer nope"}
        )
        metrics = await http.get("/metrics")
    assert ok.status_code == 200
    assert refused.status_code == 401  # the engine's own refusal, relayed
    assert metrics.status_code == 200
