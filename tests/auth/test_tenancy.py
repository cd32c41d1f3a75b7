"""Stored responses belong to the tenant that made them: another tenant's key gets 404 on
retrieve, input_items, cancel, delete and `previous_response_id`, as for an unknown id."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from gateway.auth.principal import hash_key
from gateway.testing.servers import RunningGateway, gateway, replica_config, sim_engines

MODEL = "kvgate-sim"
KEYS = [
    {"name": "alice", "key_sha256": hash_key("sk-alice"), "tenant": "acme"},
    {"name": "alice2", "key_sha256": hash_key("sk-alice2"), "tenant": "acme"},
    {"name": "mallory", "key_sha256": hash_key("sk-mallory"), "tenant": "evil"},
]


@pytest.fixture
async def gw() -> AsyncIterator[RunningGateway]:
    async with (
        sim_engines(2, "instant") as engines,
        gateway(
            engines,
            auth={"keys": KEYS},
            models={"discover": False},
            replicas=replica_config(engines, models=[MODEL]),
        ) as gw,
    ):
        yield gw


def _client(gw: RunningGateway, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=gw.url, timeout=10, headers={"authorization": f"Bearer {key}"}
    )


async def test_another_tenant_gets_404_on_every_stored_response_route(gw: RunningGateway) -> None:
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="sk-alice", max_retries=0
    ) as alice:
        made = await alice.responses.create(model=MODEL, input="a secret", store=True)
    rid = made.id
    async with _client(gw, "sk-mallory") as mallory:
        for method, path in (
            ("GET", f"/v1/responses/{rid}"),
            ("GET", f"/v1/responses/{rid}/input_items"),
            ("POST", f"/v1/responses/{rid}/cancel"),
            ("DELETE", f"/v1/responses/{rid}"),
        ):
            resp = await mallory.request(method, path)
            assert resp.status_code == 404, (method, path, resp.text)
            assert resp.json()["error"]["message"] == f"Response with id '{rid}' not found."
        cont = await mallory.post(
            "/v1/responses",
            json={"model": MODEL, "input": "and then?", "previous_response_id": rid},
        )
        assert cont.status_code == 404 and cont.json()["error"]["param"] == "previous_response_id"
    # Its own tenant, through another of its keys, reads and continues it.
    async with _client(gw, "sk-alice2") as alice2:
        got = await alice2.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json()["id"] == rid
        cont = await alice2.post(
            "/v1/responses",
            json={"model": MODEL, "input": "and then?", "previous_response_id": rid},
        )
        assert cont.status_code == 200, cont.text
