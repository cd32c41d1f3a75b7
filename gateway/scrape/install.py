"""Wires the scraper into a gateway (listed in `gateway.app.FEATURE_INSTALLERS`)."""

from __future__ import annotations

from gateway.health import HealthMonitor
from gateway.scrape.config import EngineKind, ScrapeSettings
from gateway.scrape.scraper import MetricsScraper
from gateway.scrape.shared import ScrapeShare
from gateway.state import GatewayState
from gateway.store.redis import RedisStore
from gateway.types import ReplicaId
from gateway.upstream import UpstreamClient
from gateway.upstream.h1_client import H1Client

# Only an unreachable replica says something about its health; a slow or unreadable
# /metrics (busy engine, metrics disabled) does not, and must not eject it. A scrape is
# not a probe: its success never clears a failed `/health` probe (a vLLM whose engine core
# died still serves /metrics).
HEALTH_REASONS = frozenset({"connect"})


class ScrapeHealth:
    """`ScrapeHealthSink` over the core's health monitor."""

    def __init__(self, health: HealthMonitor) -> None:
        self._health = health

    def scrape_succeeded(self, replica: ReplicaId) -> None:
        self._health.scrape_success(replica)

    def scrape_failed(self, replica: ReplicaId, reason: str) -> None:
        if reason in HEALTH_REASONS:
            self._health.record_failure(replica, passive=True, evidence=f"metrics scrape: {reason}")


def scrape_settings(state: GatewayState) -> ScrapeSettings:
    """The `scrape:` section with each replica's configured engine kind folded in."""
    settings: ScrapeSettings = state.settings.scrape
    engines = {
        r.id: EngineKind(r.engine.value)
        for r in state.settings.replicas
        if r.engine.value != EngineKind.AUTO.value
    }
    engines.update(settings.engines)  # the scrape section has the last word
    return settings.model_copy(update={"engines": engines})


def shared_scraping(state: GatewayState, settings: ScrapeSettings) -> ScrapeShare | None:
    """The lease-sharing side of the scraper, when a Redis store is shared (installed
    before this feature); None scrapes every replica, as without a store."""
    store = state.extras.get("store")
    if not settings.shared or not isinstance(store, RedisStore):
        return None
    return ScrapeShare(
        lambda: None if store.degraded else store.redis,
        store.keys,
        store.instance_id,
        lease_ttl_s=settings.lease_ttl_s,
        clock=state.cluster.clock,
    )


def probes_client(state: GatewayState) -> UpstreamClient | None:
    """The health probes' client, when it is the `h1` one (the scraper's own kind): vLLM
    and SGLang close a connection idle for 5 s, so reads of a quiet replica (every
    `scrape.idle_interval_s`) would each open a new one, several times a read's CPU; the
    probes (every `health.idle_interval_s`, under 5 s) keep one open that the reads reuse.
    None: the scraper opens a client of its own."""
    client = state.health.client
    return client if isinstance(client, H1Client) else None


def install(state: GatewayState) -> None:
    settings = scrape_settings(state)
    state.cluster.stale_after = settings.stale_after_s
    if not settings.enabled:
        return
    cluster = state.cluster
    scraper = MetricsScraper(
        settings,
        lambda: tuple(cluster.members.values()),
        client=probes_client(state),
        headers=state.settings.upstream.auth_headers(),
        registry=state.metrics.registry,
        on_load=cluster.publish_load,
        health=ScrapeHealth(state.health),
        clock=cluster.clock,
        share=shared_scraping(state, settings),
        in_flight=cluster.in_flight,
    )
    cluster.on_busy(scraper.wake)
    state.services.append(scraper)
    state.extras["scrape"] = scraper
