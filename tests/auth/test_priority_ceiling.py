"""A key's priority ceiling holds however a priority is stated (X-Priority, body `priority`
as a class or a vLLM integer), admission on or off; `admission.key_classes` applies with
keys on. Real gateway, simulated engines that schedule by priority and record it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.auth.principal import hash_key
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, replica_config

MODEL = "kvgate-sim"
KEYS: list[dict[str, Any]] = [
    {"name": "alice", "key_sha256": hash_key("sk-alice"), "max_priority": "default"},
    {"name": "carol", "key_sha256": hash_key("sk-carol")},
]


@pytest.fixture(params=[False, True], ids=["admission-off", "admission-on"])
async def gw(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RunningGateway, SimEngine]]:
    engine = SimEngine(PROFILES["instant"], index=0, priority_scheduling=True)
    await engine.start()
    try:
        async with gateway(
            [engine],
            auth={"keys": KEYS},
            admission={"enabled": request.param, "key_classes": {"sk-carol": "batch"}},
            models={"discover": False},
            replicas=replica_config([engine], models=[MODEL], priority_scheduling=True),
        ) as gw:
            yield gw, engine
    finally:
        await engine.stop()


async def _post(
    gw: RunningGateway, key: str, headers: dict[str, str] | None = None, **body: Any
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        return await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
            headers={"authorization": f"Bearer {key}", **(headers or {})},
        )


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"x-priority": "interactive"}, {}),
        ({}, {"priority": -100}),  # the attempt: ran at -300 with admission off
        ({}, {"priority": 0}),  # interactive's engine priority
        ({}, {"priority": "interactive"}),
        ({}, {"priority": "-5"}),
        ({"x-priority": "batch"}, {"priority": -100}),  # a worse header does not hide it
    ],
)
async def test_better_than_the_ceiling_is_403_every_way(
    gw: tuple[RunningGateway, SimEngine], headers: dict[str, str], body: dict[str, Any]
) -> None:
    server, engine = gw
    resp = await _post(server, "sk-alice", headers, **body)
    assert resp.status_code == 403, resp.text
    error = resp.json()["error"]
    assert error["type"] == "permission_error" and error["param"] == "priority"
    assert not [r for r in engine.request_log if r.endpoint == "chat"]


@pytest.mark.parametrize(
    ("headers", "body"),
    [({}, {}), ({"x-priority": "batch"}, {}), ({}, {"priority": "default"}), ({}, {"priority": 2})],
)
async def test_at_or_below_the_ceiling_is_served(
    gw: tuple[RunningGateway, SimEngine], headers: dict[str, str], body: dict[str, Any]
) -> None:
    server, _ = gw
    resp = await _post(server, "sk-alice", headers, **body)
    if isinstance(body.get("priority"), str) and not server.state.settings.admission.enabled:
        # Not a class without admission: the engine's own 400 (vLLM wants an integer).
        assert resp.status_code == 400 and "integer" in resp.text
        return
    assert resp.status_code == 200, resp.text


async def test_key_classes_apply_with_keys_on(gw: tuple[RunningGateway, SimEngine]) -> None:
    server, engine = gw
    if not server.state.settings.admission.enabled:
        pytest.skip("key_classes are admission's")
    assert (await _post(server, "sk-alice")).status_code == 200
    # carol's key is mapped to batch: it wins over what the request says.
    assert (await _post(server, "sk-carol", {"x-priority": "interactive"})).status_code == 200
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        resp = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": "sk-carol"},
        )
    assert resp.status_code == 200
    chats = [r.priority for r in engine.request_log if r.endpoint == "chat"]
    assert len(chats) == 3
    default, carol, carol_x_api_key = chats
    assert carol == carol_x_api_key > default
