"""Identity stage: what the caller's API key allows for this request.

With keys off (no principal in the scope) nothing happens. With keys on: the model must be
in the key's models, the priority class at or below its ceiling (a request naming no class
gets the ceiling at best), the tenant is the key's (a different `X-Tenant-Id` is refused),
and the replicas it may land on are those of its pools. Refusals are 403. The request's
token estimate is charged to the key's and tenant's budgets (gateway.auth.limiter).
"""

from __future__ import annotations

import dataclasses

from gateway.auth.principal import SCOPE_KEY as PRINCIPAL_KEY
from gateway.auth.principal import Principal
from gateway.errors import Forbidden
from gateway.middleware.rate_limit import TICKET_KEY
from gateway.proxy.exchange import Exchange
from gateway.state import GatewayState
from gateway.types import RouteRequest


class Identity:
    __slots__ = ("_classes", "_default_output", "_state")

    def __init__(self, state: GatewayState) -> None:
        self._state = state
        self._classes = {c.name: i for i, c in enumerate(state.settings.admission.classes)}
        self._default_output = state.settings.auth.default_output_tokens

    def principal(self, ex: Exchange) -> Principal | None:
        principal: Principal | None = ex.scope.get(PRINCIPAL_KEY)
        return principal

    def narrow(self, ex: Exchange, principal: Principal, request: RouteRequest) -> RouteRequest:
        """`request` within the key's grants (after admission resolved its class)."""
        changes: dict[str, object] = {}
        if request.tenant is not None and request.tenant != principal.tenant:
            raise Forbidden(
                f"API key {principal.name!r} acts for tenant {principal.tenant!r}, "
                f"not {request.tenant!r}."
            )
        if request.tenant != principal.tenant:
            changes["tenant"] = principal.tenant
        ceiling = principal.max_priority
        if ceiling is not None:
            rank = self._classes.get(request.priority_class)
            top = self._classes.get(ceiling, len(self._classes))
            if rank is None or rank < top:
                if ex.named_class:
                    raise Forbidden(
                        f"API key {principal.name!r} may ask for priority {ceiling!r} at "
                        f"best, not {request.priority_class!r}.",
                        param="priority",
                    )
                changes["priority_class"] = ceiling
        if principal.pools:
            ex.pools = principal.pools
            cluster = self._state.cluster
            if not any(
                r.pool in principal.pools and r.serves(request.model)
                for r in cluster.members.values()
            ):
                raise Forbidden(
                    f"API key {principal.name!r} may use pools {sorted(principal.pools)}; "
                    f"none of them serves `{request.model}`."
                )
        ticket = ex.scope.get(TICKET_KEY)
        if ticket is not None:
            output = request.max_tokens or self._default_output
            ticket.charge(request.prompt_tokens, output)
        return dataclasses.replace(request, **changes) if changes else request  # type: ignore[arg-type]
