"""Wires KV cache events into a gateway (listed in `gateway.app.FEATURE_INSTALLERS`)."""

from __future__ import annotations

from pathlib import Path

from gateway.errors import ConfigError
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.config import KVEventsSettings, TokenizerKind, TokenizerSettings
from gateway.kvevents.evidence import EventEvidence
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex
from gateway.kvevents.intake import EventIntake, Source
from gateway.kvevents.metrics import KVEventMetrics
from gateway.kvevents.render import HFRenderer, Renderer, SimRenderer, TokenIdsOnly
from gateway.kvevents.stage import TokenStage
from gateway.kvevents.tokcache import TokenCache
from gateway.state import GatewayState
from gateway.types import ReplicaId


def make_cache(settings: TokenizerSettings) -> TokenCache | None:
    if settings.cache_entries == 0 or settings.cache_bytes == 0:
        return None
    return TokenCache(settings.cache_entries, settings.cache_bytes)


def make_renderer(
    settings: TokenizerSettings, cache: TokenCache | None = None, block_size: int = 16
) -> Renderer:
    if settings.kind is TokenizerKind.SIM:
        return SimRenderer(cache, block_size)
    if settings.kind is TokenizerKind.HF:
        assert settings.path is not None
        template = None
        try:
            if settings.chat_template:
                template = Path(settings.chat_template).read_text()
            specials = {"bos_token": settings.bos_token, "eos_token": settings.eos_token}
            return HFRenderer(settings.path, template, specials, cache, block_size)
        except (OSError, ValueError, ImportError) as exc:
            raise ConfigError(
                f"cannot load the tokenizer: {exc}", param="kv_events.tokenizer"
            ) from exc
    return TokenIdsOnly()


def install(state: GatewayState) -> None:
    settings: KVEventsSettings = state.settings.kv_events
    if not settings.enabled:
        return
    members = set(state.cluster.members)
    unknown = [s.replica for s in settings.sources if members and s.replica not in members]
    if unknown:
        raise ConfigError(
            f"kv_events.sources name unknown replica(s) {unknown}", param="kv_events.sources"
        )
    metrics = KVEventMetrics(state.metrics.registry)
    index = EventIndex(settings.max_blocks_per_replica)
    feed = EventFeed(index, metrics, warmup_s=settings.warmup_s)
    metrics.watch(index, feed.states)
    bridge = PromptBridge(settings.bridge_max_entries)
    evidence = EventEvidence(
        index, feed, bridge, settings.medium_weights, metrics, block_size=settings.block_size
    )
    sources = tuple(
        Source(ReplicaId(s.replica), s.endpoint, s.replay_endpoint, s.topic)
        for s in settings.sources
    )
    intake = EventIntake(sources, feed, replay_timeout_s=settings.replay_timeout_s)
    tok = settings.tokenizer
    cache = make_cache(tok) if tok.kind is not TokenizerKind.NONE else None
    stage = TokenStage(
        make_renderer(tok, cache, settings.block_size),
        bridge,
        block_size=settings.block_size,
        workers=tok.workers,
        max_pending=tok.max_pending,
        timeout_s=tok.timeout_s,
        metrics=metrics,
        cache=cache,
        route_budget_s=tok.route_budget_ms / 1000,
        synced=feed.any_synced,
    )
    state.cluster.set_cache_evidence(evidence)
    if tok.route_budget_ms > 0:
        state.pre_route = stage.before_route
    state.services.extend((stage, intake))
    state.dispatch_observers.extend((evidence.dispatched, stage.dispatched))
    state.observers.extend((evidence.finished, stage))
    state.extras["kv_events"] = KVEventsFeature(index, feed, bridge, evidence, intake, stage)


class KVEventsFeature:
    """What tests and admin code reach through `state.extras["kv_events"]`."""

    def __init__(
        self,
        index: EventIndex,
        feed: EventFeed,
        bridge: PromptBridge,
        evidence: EventEvidence,
        intake: EventIntake,
        stage: TokenStage,
    ) -> None:
        self.index = index
        self.feed = feed
        self.bridge = bridge
        self.evidence = evidence
        self.intake = intake
        self.stage = stage
