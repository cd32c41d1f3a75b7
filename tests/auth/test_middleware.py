"""The front door's two middlewares around a small app on a real uvicorn server: which
credentials are read, what reaches the app, each refusal's status, shape and metric, and
the concurrency slot given back on every way a response can end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from gateway.auth.config import KeySettings, Limits
from gateway.auth.limiter import LocalLimiter, Ticket
from gateway.auth.metrics import AuthMetrics
from gateway.auth.middleware import AuthMiddleware, presented_key
from gateway.auth.principal import KeyRing, Principal, hash_key
from gateway.auth.rate_limit import RateLimitMiddleware
from gateway.scope import PRINCIPAL_KEY, TICKET_KEY
from gateway.serving import RunningServer, start_server

KEYS = [
    KeySettings(name="plain", key_sha256=hash_key("sk-plain")),
    KeySettings(name="ops", key_sha256=hash_key("sk-ops"), admin=True),
    KeySettings(name="gone", key_sha256=hash_key("sk-gone"), disabled=True),
    KeySettings(
        name="one",
        key_sha256=hash_key("sk-one"),
        tenant="acme",
        limits=Limits(concurrent_requests=1, requests_per_minute=100),
    ),
]


async def whoami(request: Request) -> JSONResponse:
    principal: Principal | None = request.scope.get(PRINCIPAL_KEY)
    ticket = request.scope.get(TICKET_KEY)
    return JSONResponse(
        {
            "name": principal.name if principal else None,
            "tenant": principal.tenant if principal else None,
            "ticket": isinstance(ticket, Ticket),
        }
    )


async def slow_stream(request: Request) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"first\n"
        await asyncio.sleep(30)  # the client leaves long before
        yield b"never\n"

    return StreamingResponse(chunks())


async def broken_stream(request: Request) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"first\n"
        raise RuntimeError("the app failed mid-response")

    return StreamingResponse(chunks())


async def fails(request: Request) -> PlainTextResponse:
    raise RuntimeError("the app failed before answering")


@dataclass
class FrontDoor:
    server: RunningServer
    limiter: LocalLimiter
    registry: CollectorRegistry

    @property
    def url(self) -> str:
        return self.server.url

    def in_flight(self, scope: str) -> int:
        return self.limiter.counters.usage(scope, time.time()).concurrent

    def refusals(self, reason: str) -> float:
        value = self.registry.get_sample_value("kvgate_auth_refusals_total", {"reason": reason})
        return value or 0.0


@pytest.fixture
async def door() -> AsyncIterator[FrontDoor]:
    routes = [
        Route(path, whoami, methods=["GET", "POST"])
        for path in ("/v1/models", "/admin/state", "/health", "/metrics", "/v1/messages")
    ]
    routes += [
        Route("/v1/slow", slow_stream),
        Route("/v1/broken", broken_stream),
        Route("/v1/fails", fails),
    ]
    registry = CollectorRegistry()
    metrics = AuthMetrics(registry)
    limiter = LocalLimiter()
    ring = KeyRing(KEYS, {}, ["interactive", "default"])
    inner = RateLimitMiddleware(Starlette(routes=routes), limiter=limiter, metrics=metrics)
    app = AuthMiddleware(
        inner,
        ring=ring,
        needs_admin=lambda path: path.startswith("/admin") or path == "/metrics",
        metrics=metrics,
    )
    server = await start_server(app)
    try:
        yield FrontDoor(server, limiter, registry)
    finally:
        await server.stop()


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": "Bearer sk-plain"},
        {"authorization": "bearer sk-plain"},
        {"authorization": "Bearer   sk-plain"},
        {"api-key": "sk-plain"},
        {"x-api-key": "sk-plain"},
    ],
)
async def test_every_credential_header_finds_the_key(
    door: FrontDoor, headers: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=door.url) as http:
        answer = await http.get("/v1/models", headers=headers)
    assert answer.status_code == 200
    # A key without limits reaches the app with its principal and takes no ticket.
    assert answer.json() == {"name": "plain", "tenant": "plain", "ticket": False}
    assert not any(h.startswith("x-ratelimit") for h in answer.headers)


@pytest.mark.parametrize(
    ("headers", "status", "reason", "words"),
    [
        ({}, 401, "no_key", "didn't provide an API key"),
        ({"authorization": "Bearer"}, 401, "no_key", "didn't provide an API key"),
        ({"authorization": "Basic c2stcGxhaW4="}, 401, "no_key", "didn't provide"),
        ({"authorization": "Bearer sk-nobody"}, 401, "unknown_key", "Incorrect or revoked"),
        ({"x-api-key": "sk-gone"}, 401, "unknown_key", "Incorrect or revoked"),
    ],
)
async def test_a_refused_credential_gets_its_openai_error_and_is_counted(
    door: FrontDoor, headers: dict[str, str], status: int, reason: str, words: str
) -> None:
    before = door.refusals(reason)
    async with httpx.AsyncClient(base_url=door.url) as http:
        answer = await http.post("/v1/models", headers=headers, json={})
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["type"] == "authentication_error"
    assert error["code"] == "invalid_api_key"
    assert words in error["message"]
    assert "sk-" not in error["message"]  # a key is never echoed back
    assert door.refusals(reason) == before + 1


async def test_admin_paths_need_an_admin_key(door: FrontDoor) -> None:
    async with httpx.AsyncClient(base_url=door.url) as http:
        for path in ("/admin/state", "/metrics"):
            refused = await http.get(path, headers={"authorization": "Bearer sk-plain"})
            assert refused.status_code == 403, path
            error = refused.json()["error"]
            assert error["type"] == "permission_error"
            assert "'plain'" in error["message"] and path in error["message"]
            served = await http.get(path, headers={"authorization": "Bearer sk-ops"})
            assert served.status_code == 200 and served.json()["name"] == "ops"
    assert door.refusals("not_admin") == 2


async def test_probes_pass_without_a_key_and_without_a_principal(door: FrontDoor) -> None:
    async with httpx.AsyncClient(base_url=door.url) as http:
        answer = await http.get("/health")
        with_key = await http.get("/health", headers={"authorization": "Bearer sk-nobody"})
    assert answer.status_code == with_key.status_code == 200
    assert answer.json()["name"] is None


async def test_anthropic_routes_refuse_in_anthropics_shape(door: FrontDoor) -> None:
    async with httpx.AsyncClient(base_url=door.url) as http:
        answer = await http.post("/v1/messages", json={})
    assert answer.status_code == 401
    body = answer.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"


async def test_a_limited_key_gets_a_ticket_and_openais_headers(door: FrontDoor) -> None:
    async with httpx.AsyncClient(base_url=door.url, headers={"x-api-key": "sk-one"}) as http:
        first = await http.get("/v1/models")
        second = await http.get("/v1/models")
    assert first.json() == {"name": "one", "tenant": "acme", "ticket": True}
    assert first.headers["x-ratelimit-limit-requests"] == "100"
    assert first.headers["x-ratelimit-remaining-requests"] == "99"
    assert second.headers["x-ratelimit-remaining-requests"] == "98"
    # Each header once, though two middlewares touched the response.
    assert len(first.headers.get_list("x-ratelimit-limit-requests")) == 1
    assert door.in_flight("key:one") == 0


async def _released(door: FrontDoor, scope: str) -> bool:
    for _ in range(200):
        if door.in_flight(scope) == 0:
            return True
        await asyncio.sleep(0.025)
    return False


async def test_the_slot_is_held_while_streaming_and_given_back_when_the_client_leaves(
    door: FrontDoor,
) -> None:
    async with httpx.AsyncClient(base_url=door.url, headers={"x-api-key": "sk-one"}) as http:
        async with http.stream("GET", "/v1/slow") as held:
            assert await held.aiter_lines().__anext__() == "first"
            assert door.in_flight("key:one") == 1
            busy = await http.get("/v1/models")
            assert busy.status_code == 429
            assert busy.json()["error"]["code"] == "rate_limit_exceeded"
            assert busy.headers["retry-after"] == "1"
        # Leaving mid-stream: the server cancels the app, the slot comes back.
        assert await _released(door, "key:one")
        assert (await http.get("/v1/models")).status_code == 200
    assert door.refusals("quota_concurrent") == 1


async def test_the_slot_is_given_back_when_the_app_fails_before_answering(
    door: FrontDoor,
) -> None:
    async with httpx.AsyncClient(base_url=door.url, headers={"x-api-key": "sk-one"}) as http:
        assert (await http.get("/v1/fails")).status_code == 500
        assert await _released(door, "key:one")
        assert (await http.get("/v1/models")).status_code == 200


async def test_the_slot_is_given_back_when_the_app_fails_mid_response(door: FrontDoor) -> None:
    async with httpx.AsyncClient(base_url=door.url, headers={"x-api-key": "sk-one"}) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.get("/v1/broken")  # the connection is cut mid-body
        assert await _released(door, "key:one")
        assert (await http.get("/v1/models")).status_code == 200


def test_presented_key_reads_the_first_credential_header() -> None:
    assert presented_key([(b"authorization", b"Bearer a"), (b"x-api-key", b"b")]) == b"a"
    assert presented_key([(b"x-api-key", b"b"), (b"authorization", b"Bearer a")]) == b"b"
    assert presented_key([(b"authorization", b"Token a")]) is None
    assert presented_key([(b"api-key", b"")]) is None
    assert presented_key([]) is None
