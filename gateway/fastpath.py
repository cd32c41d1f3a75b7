"""The gateway's Starlette app, with the proxy endpoints dispatched ahead of its router.

Every inference request is a POST to one of a few fixed paths. Sending those straight to
the proxy endpoint skips Starlette's middleware stack and its route matching, which cost
tens of microseconds per request. The proxy endpoint already answers every failure in
OpenAI's error shape and applies the request-id rule itself, so nothing is lost. All other
requests (and any under a root path) take the ordinary Starlette route.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send


class GatewayApp(Starlette):
    def __init__(self, *, fast_posts: Mapping[str, ASGIApp], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fast: Mapping[str, ASGIApp] = MappingProxyType(dict(fast_posts))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self._fast.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
