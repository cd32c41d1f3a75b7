"""The one check every console admin endpoint passes through, besides the front door.

With API keys configured, the auth middleware (gateway.auth.middleware) already admits
only admin keys to /admin/*, while the page itself is open (it holds no data). This guard
adds what keys cannot say: `console.local_only`, loopback clients only.
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.console.config import ConsoleSettings

_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def _forbidden(message: str) -> Response:
    body = {
        "error": {
            "message": message,
            "type": "permission_error",
            "param": None,
            "code": "forbidden",
        }
    }
    return Response(orjson.dumps(body), 403, media_type="application/json")


def admin_guard(request: Request, settings: ConsoleSettings) -> Response | None:
    """None lets the request through; otherwise the response to send instead.

    Everything is allowed unless `console.local_only` is set, which admits loopback
    clients only.
    """
    if settings.local_only:
        host = request.client.host if request.client is not None else ""
        if host not in _LOOPBACK:
            return _forbidden("the console's admin endpoints answer loopback clients only")
    return None
