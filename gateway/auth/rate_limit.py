"""Quotas per key and tenant on every route: 429 with Retry-After and x-ratelimit-*.

Requests per minute and concurrent requests are counted here, for every authenticated
request; token budgets are checked here against what was already used and charged by
the proxy once it has read the body (gateway.proxy.endpoint). The ticket goes into
``scope["kvgate.ticket"]``; its concurrency slot is released when the response ends,
whatever happens.
"""

from __future__ import annotations

from gateway.asgi import ASGIApp, Message, Receive, Scope, Send
from gateway.auth.limiter import Limiter, Ticket
from gateway.auth.limits import scopes_of
from gateway.auth.metrics import AuthMetrics
from gateway.auth.middleware import send_gateway_error
from gateway.auth.principal import Principal
from gateway.errors import RateLimited
from gateway.scope import PRINCIPAL_KEY, TICKET_KEY


class RateLimitMiddleware:
    def __init__(
        self, app: ASGIApp, *, limiter: Limiter, metrics: AuthMetrics | None = None
    ) -> None:
        self.app = app
        self.limiter = limiter
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        principal: Principal | None = scope.get(PRINCIPAL_KEY)
        if principal is None or not principal.limited:
            await self.app(scope, receive, send)
            return
        outcome = await self.limiter.acquire(scopes_of(principal))
        if not isinstance(outcome, Ticket):
            what = outcome.kind.replace("_", " ")
            err = RateLimited(
                f"Rate limit reached for {outcome.scope} "
                f"{principal.name if outcome.scope == 'key' else principal.tenant!r}: {what}. "
                f"Retry after {outcome.retry_after_s:.1f} s.",
                retry_after_s=outcome.retry_after_s,
            )
            err.headers.update({k.decode(): v.decode() for k, v in outcome.headers})
            if self.metrics is not None:
                self.metrics.refusals.labels(f"quota_{outcome.kind}").inc()
            await send_gateway_error(send, err, scope["path"])
            return
        ticket = outcome
        scope[TICKET_KEY] = ticket
        extra = ticket.headers

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start" and extra:
                message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            ticket.release()
