"""The end of a request for the key that made it: its usage series and its quota ticket's
settlement, as a `gateway.hooks.RequestMeter` (the outcome stage calls it, knowing neither)."""

from __future__ import annotations

from gateway.asgi import Scope
from gateway.auth.limiter import Ticket
from gateway.auth.metrics import AuthMetrics
from gateway.auth.principal import Principal
from gateway.hooks import RequestUse
from gateway.scope import PRINCIPAL_KEY, TICKET_KEY
from gateway.usage import usage_tokens


class AuthMeter:
    __slots__ = ("_metrics",)

    def __init__(self, metrics: AuthMetrics) -> None:
        self._metrics = metrics

    def __call__(self, scope: Scope, use: RequestUse) -> None:
        principal: Principal | None = scope.get(PRINCIPAL_KEY)
        if principal is not None:
            used_in, _, used_out = usage_tokens(use.usage)
            self._metrics.record(principal, use.status, used_in, used_out)
        ticket: Ticket | None = scope.get(TICKET_KEY)
        if ticket is not None:
            settle(ticket, use)


def settle(ticket: Ticket, use: RequestUse) -> None:
    """Charge `ticket` what the request used, as far as it is known."""
    if use.usage is not None:
        prompt, _, completion = usage_tokens(use.usage)
        ticket.settle(prompt, completion, exact=True)
    elif use.ok:
        ticket.settle(None, None)  # answered, usage unknown: the estimate stands
    elif use.engaged:
        # An engine took the prompt (or may have: the client left while it was sent): its
        # estimate stands; output is what went out (`delivered`).
        ticket.settle(None, 0)
    else:
        # Refused before any engine worked on it (no replica, every connection refused),
        # though the gateway's own error went out.
        ticket.settle(0, 0)
