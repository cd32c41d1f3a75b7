"""Wires the engine facts service into a gateway (listed in
`gateway.app.FEATURE_INSTALLERS`, after the scraper and before the KV events, which
listen to it). Readers find it at `state.extras["facts"]`."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.facts.service import EngineFactsService
from gateway.health import Health
from gateway.state import GatewayState
from gateway.types import ReplicaId, ReplicaState


def install(state: GatewayState) -> None:
    cluster = state.cluster
    headers = {k.decode(): v.decode() for k, v in state.settings.upstream.auth_headers()}
    facts = EngineFactsService(
        lambda: {rid: r.url for rid, r in cluster.members.items()}, headers=headers
    )
    out: set[ReplicaId] = set()
    previous = state.health.on_change

    def health_changed(replica: ReplicaId, health: Health) -> None:
        if previous is not None:
            previous(replica, health)
        if health is Health.EJECTED:
            out.add(replica)
        elif replica in out:
            out.discard(replica)
            facts.readmitted(replica)

    def membership_changed(_replicas: Sequence[ReplicaState]) -> None:
        facts.wake()

    state.health.on_change = health_changed
    cluster.on_membership_change(membership_changed)
    scraper = state.extras.get("scrape")
    if scraper is not None:
        scraper.capacity_of = facts.capacity
    state.services.append(facts)
    state.extras["facts"] = facts
