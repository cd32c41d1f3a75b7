"""Wires PD into a gateway (listed in `gateway.app.FEATURE_INSTALLERS`)."""

from __future__ import annotations

from gateway.hooks import InboundRewrite
from gateway.pd.cached import ServedPrefixes, find_estimator
from gateway.pd.colocated import ColocatedFirst
from gateway.pd.config import PDSettings
from gateway.pd.decision import CLIENT_PD_HEADERS, without_client_pd_fields
from gateway.pd.dispatcher import PDDispatcher
from gateway.pd.metrics import PDMetrics
from gateway.policy import EstimatesCachedTokens, PolicyContext, ReactsToMembership, build_policy
from gateway.state import GatewayState
from gateway.types import Role


def install(state: GatewayState) -> None:
    settings: PDSettings = state.settings.pd
    members = tuple(state.cluster.members.values())
    if not settings.allow_client_fields:
        # A client may not steer the engines' KV hand-off itself (gateway.pd.decision).
        state.inbound_rewrites.append(InboundRewrite(without_client_pd_fields, CLIENT_PD_HEADERS))
    if settings.enabled or any(r.role is not Role.BOTH for r in members):
        state.wrap_router(
            "pd_colocated", lambda inner: ColocatedFirst(inner, settings.serves_whole)
        )
    if not settings.enabled:
        return
    decode_policy = build_policy(settings.decode_policy, None, PolicyContext(replicas=members))
    if isinstance(decode_policy, ReactsToMembership):
        state.cluster.on_membership_change(decode_policy.membership_changed)
    estimator: EstimatesCachedTokens | None = find_estimator(state.router)
    if estimator is None:
        served = ServedPrefixes()
        state.observers.append(served.observe)
        estimator = served
    dispatcher = PDDispatcher(
        settings,
        lambda: state.router,
        decode_policy,
        PDMetrics(state.metrics.registry),
        estimator,
        placed=lambda: state.router_placed,
    )
    state.observers.append(dispatcher.finished)
    state.dispatcher = dispatcher
    state.extras["pd"] = dispatcher
