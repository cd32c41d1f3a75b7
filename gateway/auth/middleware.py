"""API keys on every route: 401 without a valid key, 403 on admin routes without admin.

Installed only when keys are on (gateway.auth.install). The key comes from
`Authorization: Bearer <key>` (what the OpenAI SDKs send) or `api-key` / `x-api-key`. The
principal goes into ``scope["kvgate.principal"]``; the key itself is never stored.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.asgi import ASGIApp, Receive, Scope, Send
from gateway.auth.metrics import AuthMetrics
from gateway.auth.principal import KeyRing
from gateway.errors import Forbidden, GatewayError, Unauthorized, error_response_parts
from gateway.scope import PRINCIPAL_KEY
from gateway.types import error_shape

PUBLIC_PATHS = frozenset({"/health", "/ready"})
_KEY_HEADERS = (b"api-key", b"x-api-key")


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name in _KEY_HEADERS and value:
            return value.strip()
    return None


async def send_gateway_error(send: Send, err: GatewayError, path: str = "") -> None:
    """`err` in the shape of the API served at `path` (Anthropic's on its routes)."""
    status, headers, body = error_response_parts(err, error_shape(path))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class AuthMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        ring: KeyRing,
        needs_admin: Callable[[str], bool],
        metrics: AuthMetrics | None = None,
        public: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.ring = ring
        # Paths that carry no data of their own (probes, the console's static page, whose
        # data comes from /admin/* with the admin key the page is given).
        self.public = PUBLIC_PATHS | public
        self.needs_admin = needs_admin
        self.metrics = metrics

    async def _refuse(self, scope: Scope, send: Send, err: GatewayError, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.refusals.labels(reason).inc()
        await send_gateway_error(send, err, scope["path"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope["headers"])
        if key is None:
            await self._refuse(
                scope,
                send,
                Unauthorized(
                    "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
                ),
                "no_key",
            )
            return
        principal = self.ring.lookup(key)
        if principal is None:
            await self._refuse(
                scope, send, Unauthorized("Incorrect or revoked API key provided."), "unknown_key"
            )
            return
        if not principal.admin and self.needs_admin(scope["path"]):
            await self._refuse(
                scope,
                send,
                Forbidden(
                    f"API key {principal.name!r} may not call {scope['path']} (admin keys only)."
                ),
                "not_admin",
            )
            return
        scope[PRINCIPAL_KEY] = principal
        await self.app(scope, receive, send)
