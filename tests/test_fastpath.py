"""Every route, fast or not, runs the middlewares added the usual way."""

from __future__ import annotations

import httpx

from gateway.app import build_app
from gateway.asgi import Message, Receive, Scope, Send
from gateway.serving import start_server
from gateway.settings import load_settings
from gateway.testing.servers import replica_config, sim_engines

SEEN: list[str] = []


class _Stamp:
    """Adds a response header and records the paths it saw."""

    def __init__(self, app: object) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # type: ignore[operator]
            return
        SEEN.append(scope["path"])

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message["headers"], (b"x-stamp", b"1")]
            await send(message)

        await self.app(scope, receive, stamped)  # type: ignore[operator]


async def test_a_middleware_added_the_usual_way_runs_on_the_fast_path() -> None:
    async with sim_engines(1, "instant") as engines:
        app = build_app(load_settings(replicas=replica_config(engines)))
        app.add_middleware(_Stamp)
        server = await start_server(app)
        try:
            async with httpx.AsyncClient(base_url=server.url) as http:
                body = {
                    "model": "kvgate-sim",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                }
                chat = await http.post("/v1/chat/completions", json=body)
                health = await http.get("/health")
                missing = await http.post("/v1/nothing", json={})
        finally:
            await server.stop()
    assert chat.status_code == 200 and chat.headers["x-stamp"] == "1"
    assert health.headers["x-stamp"] == "1" and missing.headers["x-stamp"] == "1"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert SEEN[-3:] == ["/v1/chat/completions", "/health", "/v1/nothing"]
    # The request id is set once, by the same chain, on both kinds of route.
    assert len(chat.headers.get_list("x-request-id")) == 1
    assert len(health.headers.get_list("x-request-id")) == 1
