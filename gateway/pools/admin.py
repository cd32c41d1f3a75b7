"""GET /admin/pools: read-only JSON of weights, the reason of the last change,
utilisation, pool specs, model placement and cost."""

from __future__ import annotations

from collections.abc import Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.pools.runtime import PoolsRuntime

ADMIN_PATH = "/admin/pools"


def admin_route(runtime: Callable[[], PoolsRuntime | None], path: str = ADMIN_PATH) -> Route:
    """A GET-only route; 404 in OpenAI error shape when pools are not configured."""

    async def pools(request: Request) -> Response:
        rt = runtime()
        if rt is None:
            body = {
                "error": {
                    "message": "pools are not configured",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "not_found",
                }
            }
            return Response(orjson.dumps(body), 404, media_type="application/json")
        payload = orjson.dumps(rt.admin_payload(), option=orjson.OPT_NON_STR_KEYS)
        return Response(payload, media_type="application/json")

    return Route(path, pools, methods=["GET"], name="admin_pools")
