"""Wires DNS discovery into a gateway app (listed in `gateway.app.FEATURE_INSTALLERS`).

Its service starts last, so every membership listener (router, pools, store) is running
when the first answer changes the members. After each change the model lists are fetched
again, so a new replica's models are known before the next `/v1/models`.
"""

from __future__ import annotations

from gateway.discovery.resolve import DnsResolver
from gateway.discovery.service import DiscoveryMetrics, DnsDiscovery
from gateway.state import GatewayState


def install(state: GatewayState) -> None:
    settings = state.settings.discovery
    if not settings.dns:
        return
    refresh = state.models.refresh if state.settings.models.discover else None
    service = DnsDiscovery(
        state.cluster,
        settings,
        DnsResolver(settings.nameservers, settings.timeout_s),
        DiscoveryMetrics(state.metrics.registry),
        on_change=refresh,
    )
    state.services.append(service)
    state.extras["discovery"] = service
