from __future__ import annotations

from typing import Any

import httpx

from gateway.request_id import RequestIdMiddleware
from gateway.scope import REQUEST_ID_KEY
from gateway.testing.servers import gateway, replica_config, sim_engines


async def run(
    headers: list[tuple[bytes, bytes]], response_headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    seen: dict[str, Any] = {}
    sent: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.update(scope)
        await send(
            {"type": "http.response.start", "status": 200, "headers": list(response_headers or [])}
        )
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await RequestIdMiddleware(app)({"type": "http", "headers": headers}, receive, send)
    return seen, sent


async def test_client_id_is_propagated_and_returned_once() -> None:
    scope, sent = await run([(b"x-request-id", b"abc")], [(b"X-Request-Id", b"engine-id")])
    assert scope[REQUEST_ID_KEY] == "abc"
    assert [v for k, v in sent[0]["headers"] if k.lower() == b"x-request-id"] == [b"abc"]


async def test_missing_or_bad_id_is_generated_and_forwarded() -> None:
    for headers in ([], [(b"x-request-id", b"")], [(b"x-request-id", b"x" * 500)]):
        scope, sent = await run(headers)
        rid = scope[REQUEST_ID_KEY]
        assert len(rid) == 24
        assert (b"x-request-id", rid.encode()) in scope["headers"]
        assert [v for k, v in scope["headers"] if k == b"x-request-id"] == [rid.encode()]
        assert (b"x-request-id", rid.encode()) in sent[0]["headers"]


async def test_other_scopes_pass_through() -> None:
    called: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        called.append(scope["type"])

    await RequestIdMiddleware(app)({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert called == ["lifespan"]


MODEL = "kvgate-sim"


async def test_through_a_gateway_the_engine_and_the_client_see_one_id() -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, replicas=replica_config(engines, models=[MODEL])) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        own = await http.post("/v1/chat/completions", json=body, headers={"x-request-id": "mine"})
        minted = [await http.post("/v1/chat/completions", json=body) for _ in range(2)]
        async with http.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as streamed:
            await streamed.aread()
        refused = await http.post("/v1/chat/completions", json={**body, "model": "nope"})
        non_ascii = await http.post(
            "/v1/chat/completions", json=body, headers={"x-request-id": "caf\u00e9".encode()}
        )
    engine_ids = [r.request_id for r in engines[0].request_log]
    assert own.headers["x-request-id"] == "mine"
    ids = [r.headers["x-request-id"] for r in (*minted, streamed, non_ascii)]
    assert len(set(ids)) == 4 and all(len(i) == 24 for i in ids)  # minted, all different
    # The engine was sent the very id the client got back, minted or the client's own.
    assert engine_ids[:4] == ["mine", *ids[:3]]
    assert engine_ids[4] == ids[3]
    # The gateway's own error carries one too, though no engine saw the request.
    assert refused.status_code == 404 and len(refused.headers["x-request-id"]) == 24
    assert len(engines[0].request_log) == 5
