from __future__ import annotations

from typing import Any

from gateway.request_id import RequestIdMiddleware
from gateway.scope import REQUEST_ID_KEY


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
