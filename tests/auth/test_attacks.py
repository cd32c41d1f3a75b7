"""The issue's attempts on the front door, against a real `kvgate serve` with keys on and
the documented configuration; the simulated engines (in this process) record what reaches
them. docs/auth.md keeps the table of attempts and results."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from gateway.auth.principal import hash_key
from gateway.sim.server import SimEngine
from gateway.testing.forms import BOUNDARY, CONTENT_TYPE, form
from gateway.testing.servers import sim_engines
from tests.auth.attacks import MODEL, clear_of_a_window_edge, drained_input, drained_output
from tests.auth.serve import kvgate_serve

ENGINE_KEY = "engine-secret"
KEYS: list[dict[str, Any]] = [
    {
        "name": "alice",
        "key_sha256": hash_key("sk-alice"),
        "tenant": "acme",
        "max_priority": "default",
    },
    {
        "name": "mallory",
        "key_sha256": hash_key("sk-mallory"),
        "tenant": "evil",
        "models": ["other-model"],
    },
    {"name": "gone", "key_sha256": hash_key("sk-gone"), "disabled": True},
    {"name": "ops", "key_sha256": hash_key("sk-ops"), "admin": True},
    {"name": "out", "key_sha256": hash_key("sk-out"), "limits": {"output_tokens_per_minute": 2000}},
    {"name": "in", "key_sha256": hash_key("sk-in"), "limits": {"input_tokens_per_minute": 20000}},
]


def _config(engines: list[SimEngine], **extra: Any) -> dict[str, Any]:
    return {
        "replicas": [{"id": f"e{e.index}", "url": e.url, "models": [MODEL]} for e in engines],
        "models": {"discover": False},
        "upstream": {"engine_api_key": ENGINE_KEY},
        "auth": {"keys": KEYS},
        **extra,
    }


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[str, list[SimEngine]]]:
    async with (
        sim_engines(2, "instant", api_key=ENGINE_KEY) as engines,
        kvgate_serve(_config(engines), tmp_path) as url,
    ):
        yield url, engines


def _chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **extra,
    }


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_the_key_checks_that_held_still_hold(served: tuple[str, list[SimEngine]]) -> None:
    url, engines = served
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        for headers in ({}, _bearer("sk-wrong"), _bearer("sk-gone"), {"x-api-key": "sk-gone"}):
            for path in (
                "/v1/chat/completions",
                "/v1//chat/completions",
                "/v1/chat/completions?x=1",
                "/v1/x/../chat/completions",
                "/V1/chat/completions",
            ):
                resp = await http.post(path, json=_chat(), headers=headers)
                assert resp.status_code == 401, (path, headers, resp.status_code)
            assert (await http.get("/v1/models", headers=headers)).status_code == 401
        for path in ("/admin/replicas", "/metrics"):
            assert (await http.get(path, headers=_bearer("sk-alice"))).status_code == 403
        refused = [
            await http.post("/v1/chat/completions", json=_chat(), headers=_bearer("sk-mallory")),
            await http.post(
                "/v1/chat/completions",
                json=_chat(),
                headers={**_bearer("sk-alice"), "x-priority": "interactive"},
            ),
            await http.post(
                "/v1/chat/completions",
                json=_chat(),
                headers={**_bearer("sk-alice"), "x-tenant-id": "evil"},
            ),
        ]
        assert [r.status_code for r in refused] == [403, 403, 403]
    assert not [r for e in engines for r in e.request_log]  # none reached an engine


async def test_client_keys_never_reach_an_engine(served: tuple[str, list[SimEngine]]) -> None:
    url, engines = served
    async with anthropic.AsyncAnthropic(base_url=url, api_key="sk-alice", max_retries=0) as c:
        await c.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        assert (
            await http.post("/v1/chat/completions", json=_chat(), headers={"api-key": "sk-alice"})
        ).status_code == 200
    # The gateway's own reads of the engines' model cards (gateway.facts) carry its key too.
    seen = [(p, h) for e in engines for _, p, h in e.received if p.startswith("/v1/")]
    assert len([p for p, _ in seen if p != "/v1/models"]) == 2
    for _, headers in seen:
        assert headers["authorization"] == f"Bearer {ENGINE_KEY}"
        assert "x-api-key" not in headers and "api-key" not in headers


async def test_a_body_priority_over_the_ceiling_is_403_with_admission_off(
    served: tuple[str, list[SimEngine]],
) -> None:
    url, engines = served
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        resp = await http.post(
            "/v1/chat/completions", json=_chat(priority=-100), headers=_bearer("sk-alice")
        )
    assert resp.status_code == 403 and resp.json()["error"]["param"] == "priority"
    assert not [r for e in engines for r in e.request_log]


async def test_a_model_repeated_after_the_file_is_a_400(
    served: tuple[str, list[SimEngine]],
) -> None:
    url, engines = served
    late = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\nother-model\r\n'
    ).encode()
    closing = f"--{BOUNDARY}--\r\n".encode()
    body = form({"model": MODEL}, b"\0" * 200_000)[: -len(closing)] + late + closing
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        resp = await http.post(
            "/v1/audio/transcriptions",
            content=body,
            headers={**_bearer("sk-alice"), "content-type": CONTENT_TYPE},
        )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
    assert not any(e.uploads for e in engines)


async def test_another_tenant_cannot_read_a_stored_response(
    served: tuple[str, list[SimEngine]],
) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        made = await http.post(
            "/v1/responses",
            headers=_bearer("sk-alice"),
            json={"model": MODEL, "input": "secret", "store": True},
        )
        rid = made.json()["id"]
        assert (
            await http.get(f"/v1/responses/{rid}", headers=_bearer("sk-ops"))
        ).status_code == 200
        # mallory may not use the model either; the id alone must not open it.
        other = await http.get(f"/v1/responses/{rid}", headers=_bearer("sk-mallory"))
    assert other.status_code == 404


async def test_the_two_quota_drains_get_429(tmp_path: Path) -> None:
    async with (
        sim_engines(1, "tiny") as engines,
        kvgate_serve(_config(engines), tmp_path) as url,
    ):
        await clear_of_a_window_edge(8.0)
        out = await drained_output(url, "sk-out", streams=12, read=300)
    assert "429" in out and len([g for g in out if isinstance(g, int)]) <= 7, out
    async with (
        sim_engines(1, "h200-sparse") as engines,
        kvgate_serve(_config(engines), tmp_path) as url,
    ):
        await clear_of_a_window_edge(8.0)
        got = await drained_input(url, "sk-in", prompts=10)
    assert got == [1] * 5 + ["429"] * 5, got


async def test_replaying_another_tenants_prompt_finds_nothing_cached(
    served: tuple[str, list[SimEngine]],
) -> None:
    url, engines = served
    prompt = "the board meets on friday about the acquisition of " * 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    by_key: dict[str, list[int]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        for key in ("sk-alice", "sk-ops", "sk-ops", "sk-alice"):  # ops is its own tenant
            # The same session header: the same replica, whoever asks.
            headers = {**_bearer(key), "x-session-id": "s1"}
            resp = await http.post("/v1/chat/completions", json=body, headers=headers)
            assert resp.status_code == 200
            details = resp.json()["usage"].get("prompt_tokens_details") or {}
            by_key.setdefault(key, []).append(details.get("cached_tokens") or 0)
    assert len({r for e in engines for r in [e.index] if e.request_log}) == 1
    assert by_key["sk-ops"][0] == 0  # alice's prompt warmed nothing for ops
    assert by_key["sk-ops"][1] > 1000 and by_key["sk-alice"][1] > 1000  # each its own
