"""The gateway's Starlette app: one middleware chain for every route, fast or not.

Every inference request is a POST to one of a few fixed paths. Those go straight to their
proxy endpoint, skipping Starlette's route matching and its error and exception
middlewares (tens of microseconds per request; the proxy endpoint answers every failure
in OpenAI's shape itself). The split happens *inside* the middleware stack, after the user
middlewares: a middleware added the usual way (`middleware=[...]`, `add_middleware`) runs
for the fast routes too. All other requests (and any under a root path) take Starlette's
own stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send


class FastDispatch:
    """POSTs to a fast path go to their endpoint; everything else to `rest`."""

    __slots__ = ("_fast", "_rest")

    def __init__(self, fast: Mapping[str, ASGIApp], rest: ASGIApp) -> None:
        self._fast = fast
        self._rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self._fast.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self._rest(scope, receive, send)


class GatewayApp(Starlette):
    def __init__(self, *, fast_posts: Mapping[str, ASGIApp], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fast: Mapping[str, ASGIApp] = MappingProxyType(dict(fast_posts))

    def build_middleware_stack(self) -> ASGIApp:
        user, self.user_middleware = self.user_middleware, []
        try:
            rest = super().build_middleware_stack()
        finally:
            self.user_middleware = user
        app: ASGIApp = FastDispatch(self._fast, rest)
        for cls, args, kwargs in reversed(user):
            app = cls(app, *args, **kwargs)
        return app
