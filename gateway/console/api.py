"""Routes: the page and its assets at `console.path`, the read-only JSON under `/admin/`.

| path | what |
|---|---|
| GET /admin/fleet | replicas (health, engine, pool, in-flight, queue, KV, hit rate, rates, TTFT, ring share) and the event timeline |
| GET /admin/sessions | live conversations, spread, hottest, moves and why, routing decisions, lineage index |
| GET /admin/traffic | requests/s, tokens/s, cached share, cost per 1K tokens per pool, pool weights |
| GET /admin/admission | queue depth, waits and 429s per priority class |
| GET /admin/pd | prefill/decode decisions by reason, hand-offs |
| GET /admin/history?since=T | the sampler's samples after wall time T (all kept when absent) |
"""

from __future__ import annotations

import math
from collections.abc import Callable
from importlib.resources import files
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.console import panels
from gateway.console.guard import admin_guard
from gateway.console.runtime import ConsoleRuntime

ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}


def console_asset_paths(base: str) -> frozenset[str]:
    """The page and its assets: static, no data of their own, so they need no key (the
    page reads /admin/* with the admin key it is given as `#key=...`)."""
    base = base.rstrip("/") or "/console"
    return frozenset({base, *(f"{base}/{name}" for name in ASSETS if name != "index.html")})


PANELS: dict[str, Callable[[ConsoleRuntime], dict[str, Any]]] = {
    "fleet": panels.fleet,
    "sessions": panels.sessions,
    "traffic": panels.traffic,
    "admission": panels.admission,
    "pd": panels.pd,
}
_NO_CACHE = {"cache-control": "no-store"}


def _json(payload: object) -> Response:
    body = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    return Response(body, media_type="application/json", headers=_NO_CACHE)


def _bad_request(message: str, param: str) -> Response:
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": "invalid_value",
        }
    }
    return Response(orjson.dumps(body), 400, media_type="application/json")


def load_assets() -> dict[str, bytes]:
    static = files("gateway.console").joinpath("static")
    return {name: static.joinpath(name).read_bytes() for name in ASSETS}


def console_routes(rt: ConsoleRuntime) -> list[BaseRoute]:
    assets = load_assets()
    base = rt.settings.path
    # The page names its assets absolutely: relative to `/console` they would resolve to `/`.
    assets["index.html"] = assets["index.html"].replace(b"{{base}}", base.encode())

    def panel(build: Callable[[ConsoleRuntime], dict[str, Any]]) -> Callable[..., Any]:
        async def endpoint(request: Request) -> Response:
            denied = admin_guard(request, rt.settings)
            if denied is not None:
                return denied
            rt.watch.touch()
            return _json(build(rt))

        return endpoint

    async def history(request: Request) -> Response:
        denied = admin_guard(request, rt.settings)
        if denied is not None:
            return denied
        raw = request.query_params.get("since", "0")
        try:
            since = float(raw)
        except ValueError:
            since = math.nan
        # "nan" and "inf" parse, but no sample is after them: say so instead of answering [].
        if not math.isfinite(since):
            return _bad_request(
                f"since must be a finite number (wall-clock seconds), not {raw!r}", "since"
            )
        rt.watch.touch()
        return Response(rt.sampler.since(since), media_type="application/json", headers=_NO_CACHE)

    def asset(name: str) -> Callable[..., Any]:
        body, media = assets[name], ASSETS[name]

        async def endpoint(request: Request) -> Response:
            return Response(body, media_type=media, headers=_NO_CACHE)

        return endpoint

    routes: list[BaseRoute] = [
        Route(f"/admin/{name}", panel(build), methods=["GET"], name=f"admin_{name}")
        for name, build in PANELS.items()
    ]
    routes.append(Route("/admin/history", history, methods=["GET"], name="admin_history"))
    routes.append(Route(base, asset("index.html"), methods=["GET"], name="console"))
    routes += [
        Route(f"{base}/{name}", asset(name), methods=["GET"])
        for name in ASSETS
        if name != "index.html"
    ]
    return routes
