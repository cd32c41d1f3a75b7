"""Identity stage: what the caller's API key allows for this request.

With keys off (no principal in the scope) nothing happens. With keys on: the model must be
in the key's models, the priority class at or below its ceiling (a request naming no class
gets the ceiling at best), the tenant is the key's (a different `X-Tenant-Id` is refused),
and the replicas it may land on are those of its pools. Refusals are 403. The request's
token estimate is charged to the key's and tenant's budgets (gateway.auth.limiter).
"""

from __future__ import annotations

import dataclasses

from gateway.admission.classes import BODY_FIELD, ClassMap
from gateway.errors import Forbidden
from gateway.proxy.exchange import Exchange
from gateway.scope import PRINCIPAL_KEY, TICKET_KEY, Caller, QuotaCharge
from gateway.state import GatewayState
from gateway.types import ReplicaId, RouteRequest, SessionKey


def with_sticky(r: RouteRequest, sticky: ReplicaId) -> RouteRequest:
    """`dataclasses.replace(r, sticky_replica=sticky)` at half its cost: it runs for nearly
    every request of a session. tests/proxy/test_identity.py fails when a field is added
    to RouteRequest and not here."""
    return RouteRequest(
        request_id=r.request_id,
        model=r.model,
        session_key=r.session_key,
        key_source=r.key_source,
        endpoint=r.endpoint,
        prefix_hashes=r.prefix_hashes,
        opener_hashes=r.opener_hashes,
        block_tokens=r.block_tokens,
        prompt_tokens=r.prompt_tokens,
        max_tokens=r.max_tokens,
        priority_class=r.priority_class,
        tenant=r.tenant,
        stream=r.stream,
        sticky_replica=sticky,
        lineage_hashes=r.lineage_hashes,
        lineage_tail=r.lineage_tail,
    )


def with_key(r: RouteRequest, key: SessionKey, source: str) -> RouteRequest:
    return dataclasses.replace(r, session_key=key, key_source=source)


class Identity:
    __slots__ = ("_classes", "_default_output", "_engine_classes", "_state")

    def __init__(self, state: GatewayState) -> None:
        self._state = state
        self._classes = {c.name: i for i, c in enumerate(state.settings.admission.classes)}
        self._engine_classes = ClassMap.from_settings(state.settings.admission)
        self._default_output = state.settings.auth.default_output_tokens

    def principal(self, ex: Exchange) -> Caller | None:
        principal: Caller | None = ex.scope.get(PRINCIPAL_KEY)
        return principal

    def _better_than(self, stated: object, ceiling: str) -> bool:
        """Whether a body `priority` (a class name or a vLLM integer, lower first) asks for
        more than `ceiling`. Values naming nothing known are the engine's to refuse."""
        top = self._classes.get(ceiling, len(self._classes))
        if isinstance(stated, str):
            name = stated.strip().lower()
            if name in self._classes:
                return self._classes[name] < top
            if not name.lstrip("-").isdigit():
                return False
            stated = int(name)
        if not isinstance(stated, int) or isinstance(stated, bool):
            return False
        classes = self._engine_classes
        named = classes.by_engine_priority.get(stated)
        if named is not None:
            return self._classes.get(named, len(self._classes)) < top
        return stated < classes.engine_priority.get(ceiling, stated)

    def check_body_priority(self, ex: Exchange, principal: Caller) -> None:
        """403 when the body's own `priority` asks for more than the key's ceiling, before
        admission reads it: with admission off it goes to the engine as it came, with
        admission on it names the class when no header does."""
        ceiling = principal.max_priority
        stated = ex.body.get(BODY_FIELD) if ex.body is not None else None
        if ceiling is not None and stated is not None and self._better_than(stated, ceiling):
            raise Forbidden(
                f"API key {principal.name!r} may ask for priority {ceiling!r} at best, "
                f"not {stated!r}.",
                param="priority",
            )

    def narrow(self, ex: Exchange, principal: Caller, request: RouteRequest) -> RouteRequest:
        """`request` within the key's grants (after admission resolved its class)."""
        # The tenant is the key's already (gateway.proxy.inbound).
        changes: dict[str, object] = {}
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
        ticket: QuotaCharge | None = ex.scope.get(TICKET_KEY)
        if ticket is not None:
            output = request.max_tokens or self._default_output
            ticket.charge(request.prompt_tokens, output)
        return dataclasses.replace(request, **changes) if changes else request  # type: ignore[arg-type]
