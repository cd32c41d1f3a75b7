"""Who may read the console's admin JSON, over HTTP (uvicorn on loopback, a simulated engine):
API keys first (the auth middleware), then `console.local_only` (gateway.console.guard),
while the page and its assets stay open because they hold no data."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from gateway.app import build_app
from gateway.serving import start_server
from gateway.settings import load_settings
from gateway.sim.profiles import PROFILES
from gateway.sim.server import SimEngine
from gateway.testing.servers import replica_config

KEYS = [
    {"name": "ops", "key": "sk-ops-admin", "admin": True},
    {"name": "app", "key": "sk-app-user"},
]
ADMIN = {"authorization": "Bearer sk-ops-admin"}
USER = {"authorization": "Bearer sk-app-user"}
PANELS = ("fleet", "sessions", "traffic", "admission", "pd", "history")


@contextlib.asynccontextmanager
async def console_over_http(
    *, proxy_headers: bool = False, engines: int = 1, time_scale: float = 20.0, **sections: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway before one simulated engine; `proxy_headers` as `server.proxy_headers`
    sets it in production (a load balancer on this machine, trusted for X-Forwarded-For)."""
    sims = [SimEngine(PROFILES["tiny"], index=i, time_scale=time_scale) for i in range(engines)]
    try:
        for sim in sims:
            await sim.start()
        settings = load_settings(replicas=replica_config(sims), **sections)
        server = await start_server(
            build_app(settings), proxy_headers=proxy_headers, forwarded_allow_ips="127.0.0.1"
        )
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as http:
                yield http
        finally:
            await server.stop()
    finally:
        for sim in sims:
            if sim.server is not None:
                await sim.stop()


def assert_openai_error(resp: httpx.Response, status: int, error_type: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == error_type
    assert isinstance(error["message"], str) and error["message"]


async def test_with_keys_only_an_admin_key_reads_the_panels_and_the_page_is_open() -> None:
    async with console_over_http(auth={"keys": KEYS}) as http:
        for name in PANELS:
            assert_openai_error(await http.get(f"/admin/{name}"), 401, "authentication_error")
            assert_openai_error(
                await http.get(f"/admin/{name}", headers=USER), 403, "permission_error"
            )
            ok = await http.get(f"/admin/{name}", headers=ADMIN)
            assert ok.status_code == 200, (name, ok.text)
            assert ok.headers["cache-control"] == "no-store"
            assert ok.headers["content-type"].startswith("application/json")
        # The page and its assets carry no data: no key needed, and they never leak one.
        page = await http.get("/console")
        assert page.status_code == 200 and "sk-ops-admin" not in page.text
        for asset in ("console.js", "console.css"):
            assert (await http.get(f"/console/{asset}")).status_code == 200


async def test_local_only_admits_loopback_and_refuses_a_client_forwarded_by_a_local_proxy() -> None:
    async with console_over_http(proxy_headers=True, console={"local_only": True}) as http:
        assert (await http.get("/admin/fleet")).status_code == 200
        remote = {"x-forwarded-for": "203.0.113.7"}
        for name in PANELS:
            denied = await http.get(f"/admin/{name}", headers=remote)
            assert_openai_error(denied, 403, "permission_error")
            assert denied.json()["error"]["code"] == "forbidden"
        # The page stays reachable: it is the data behind it that is local only.
        assert (await http.get("/console", headers=remote)).status_code == 200
        assert (
            await http.get("/admin/fleet", headers={"x-forwarded-for": "::1"})
        ).status_code == 200


async def test_without_proxy_headers_a_forged_forwarded_for_changes_nothing() -> None:
    # local_only reads the peer address; a header the client wrote cannot make it remote
    # (or, more to the point, make a remote client local).
    async with console_over_http(console={"local_only": True}) as http:
        forged = await http.get("/admin/fleet", headers={"x-forwarded-for": "203.0.113.7"})
        assert forged.status_code == 200
        # And the admin JSON is read-only.
        for method in ("POST", "PUT", "DELETE"):
            for name in ("fleet", "history"):
                resp = await http.request(method, f"/admin/{name}")
                assert resp.status_code == 405, (method, name, resp.status_code)


async def test_local_only_and_keys_both_apply() -> None:
    async with console_over_http(
        proxy_headers=True, auth={"keys": KEYS}, console={"local_only": True}
    ) as http:
        remote_admin = {**ADMIN, "x-forwarded-for": "198.51.100.2"}
        assert_openai_error(
            await http.get("/admin/traffic", headers=remote_admin), 403, "permission_error"
        )
        assert_openai_error(await http.get("/admin/traffic"), 401, "authentication_error")
        assert (await http.get("/admin/traffic", headers=ADMIN)).status_code == 200
