"""`PDDispatcher`: the proxy's dispatcher hook that splits a request when it pays.

Per request: decide (gateway.pd.decision); if colocated, decline and let the proxy send it
to the router's choice. Otherwise pick a prefill replica with the router itself (prefix
affinity applies among prefill replicas) and a decode replica with the decode policy
(load), then run the pool's protocol. A failed hand-off is never an error for the client:
the dispatcher declines and the proxy serves the request colocated.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.hooks import ForwardContext, RequestOutcome
from gateway.pd import mooncake, sglang, vllm
from gateway.pd.config import ModelPDSettings, PDMode, PDProtocol, PDSettings
from gateway.pd.decision import PDDecision, body_blocker, decide
from gateway.pd.metrics import PDMetrics
from gateway.policy import EstimatesCachedTokens, Policy
from gateway.types import ClusterView, ReplicaId, ReplicaState, Role, RouteRequest

if TYPE_CHECKING:
    from gateway.forward import Leg

# A safety bound on the retry-detection set (entries leave when their request finishes).
_MAX_TRACKED = 100_000


@dataclass(frozen=True, slots=True)
class Pairing:
    prefill: ReplicaState
    decodes: tuple[ReplicaId, ...]
    protocol: PDProtocol
    bootstrap_port: int


class PDDispatcher:
    def __init__(
        self,
        settings: PDSettings,
        router: Callable[[], Policy],
        decode_policy: Policy,
        metrics: PDMetrics,
        estimator: EstimatesCachedTokens,
        placed: Callable[[], Callable[[RouteRequest, ReplicaId], None] | None] = lambda: None,
    ) -> None:
        self.settings = settings
        self._router = router
        self._decode_policy = decode_policy
        self._metrics = metrics
        self._estimator = estimator
        self._placed = placed
        self._rng = random.Random(settings.seed)
        self._seen: set[int] = set()
        self._views_of: tuple[ReplicaState, ...] | None = None
        self._views: dict[tuple[str, Role], tuple[ReplicaState, ...]] = {}

    # -- the hook -----------------------------------------------------------------------
    async def dispatch(self, ctx: ForwardContext) -> Leg | None:
        request = ctx.request
        cfg = self.settings.for_model(request.model)
        if cfg is None or cfg.mode is PDMode.NEVER:
            return None  # no decision to make (and no metric label per unknown model)
        # The proxy calls the hook once per attempt: PD gets the first one only, a retry
        # after a failed hand-off (or a colocated failure) goes the colocated way.
        if id(request) in self._seen or len(self._seen) >= _MAX_TRACKED:
            return None
        self._seen.add(id(request))
        estimator = self._estimator
        decision = decide(
            cfg,
            request,
            ctx.view,
            lambda replica: estimator.cached_tokens(request, replica),
            blocker=body_blocker(ctx.body, request.endpoint),
            serves_whole=self.settings.serves_whole,
        )
        self._metrics.decided(request.model, decision)
        if not decision.disaggregate:
            return None
        return await self._handoff(ctx, cfg, decision)

    def finished(self, outcome: RequestOutcome) -> None:
        """`OutcomeObserver`: the request is over, forget it."""
        if outcome.request is not None:
            self._seen.discard(id(outcome.request))

    # -- the hand-off -------------------------------------------------------------------
    async def _handoff(
        self, ctx: ForwardContext, cfg: ModelPDSettings, decision: PDDecision
    ) -> Leg | None:
        pairing = self.pair(ctx.request, ctx.view)
        if pairing is None:
            self._metrics.handoff("none", "no_pair")
            return None
        first_byte = cfg.first_token_timeout_s if ctx.request.stream else None
        prefill = pairing.prefill
        if pairing.protocol is PDProtocol.VLLM:
            leg, outcome = await vllm.handoff(
                ctx.open_leg, ctx.leg_body, prefill.id, pairing.decodes, cfg, first_byte
            )
        elif pairing.protocol is PDProtocol.VLLM_MOONCAKE:
            leg, outcome = await mooncake.handoff(
                ctx.open_leg,
                ctx.leg_body,
                prefill.id,
                mooncake.bootstrap_addr(sglang.bootstrap_host(prefill.url), pairing.bootstrap_port),
                self.settings.engine_ids.get(prefill.id, prefill.id),
                pairing.decodes,
                cfg,
                first_byte,
            )
        else:
            leg, outcome = await sglang.handoff(
                ctx.open_leg,
                ctx.leg_body,
                prefill.id,
                sglang.bootstrap_host(prefill.url),
                pairing.bootstrap_port,
                pairing.decodes[0],
                cfg,
                first_byte,
                self._rng,
            )
        self._metrics.handoff(pairing.protocol.value, outcome)
        if leg is not None:
            self._metrics.moved(ctx.request.model, decision.kv_bytes)
            placed = self._placed()
            if placed is not None:
                placed(ctx.request, prefill.id)
        return leg

    def pair(self, request: RouteRequest, view: ClusterView) -> Pairing | None:
        """Prefill replica by the router, decode replicas (same protocol) by load."""
        prefill_view = self._role_view(view, request.model, Role.PREFILL)
        if not prefill_view.replicas:
            return None
        ranked = self._router().choose(request, prefill_view).ranked
        prefill = next((prefill_view.by_id[r] for r in ranked if r in prefill_view.by_id), None)
        if prefill is None:
            return None
        pool = self.settings.for_pool(prefill.pool)
        decode_view = self._role_view(view, request.model, Role.DECODE)
        same = tuple(
            r
            for r in decode_view.replicas
            if self.settings.for_pool(r.pool).protocol is pool.protocol
        )
        if not same:
            return None
        if len(same) < len(decode_view.replicas):
            decode_view = ClusterView(
                same, view.now, view.stale_after, view.in_flight, cache_evidence=view.cache_evidence
            )
        decodes = tuple(
            r
            for r in self._decode_policy.choose(request, decode_view).ranked
            if r in decode_view.by_id
        )
        if not decodes:
            return None
        port = self.settings.bootstrap_port(prefill.id, prefill.pool)
        return Pairing(prefill, decodes, pool.protocol, port)

    def _role_view(self, view: ClusterView, model: str, role: Role) -> ClusterView:
        if view.replicas is not self._views_of:
            self._views_of = view.replicas
            self._views.clear()
        key = (model, role)
        replicas = self._views.get(key)
        if replicas is None:
            replicas = self._views[key] = tuple(
                r for r in view.replicas if r.role is role and r.healthy and r.serves(model)
            )
        return ClusterView(
            replicas,
            view.now,
            view.stale_after,
            view.in_flight,
            cache_evidence=view.cache_evidence,
        )
