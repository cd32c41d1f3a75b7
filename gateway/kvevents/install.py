"""Wires KV cache events into a gateway (listed in `gateway.app.FEATURE_INSTALLERS`)."""

from __future__ import annotations

import logging

from gateway.errors import ConfigError
from gateway.kvevents.adapters import AdapterNames
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.config import KVEventsSettings, TokenizerKind
from gateway.kvevents.discover import EventDiscovery
from gateway.kvevents.evidence import EventEvidence
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex
from gateway.kvevents.intake import EventIntake, Source
from gateway.kvevents.metrics import KVEventMetrics
from gateway.kvevents.remote import RemoteIntake
from gateway.kvevents.stage import TokenStage
from gateway.kvevents.workers import ProcessJobs, make_cache, make_renderer
from gateway.state import GatewayState
from gateway.types import ReplicaId

log = logging.getLogger("kvgate.kvevents")


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
    intake: EventIntake | RemoteIntake
    if settings.intake == "process":
        intake = RemoteIntake(
            sources,
            feed,
            replay_timeout_s=settings.replay_timeout_s,
            max_blocks=settings.max_blocks_per_replica,
            block_size=settings.block_size,
            on_restart=metrics.intake_restarts.inc,
        )
    else:
        intake = EventIntake(
            sources,
            feed,
            replay_timeout_s=settings.replay_timeout_s,
            dynamic=settings.discover,
            block_size=settings.block_size,
        )
    listed = {s.replica for s in settings.sources}
    unlisted = [ReplicaId(r.id) for r in state.settings.replicas if r.id not in listed]
    facts = state.extras.get("facts")
    if settings.discover and unlisted and facts is not None:
        if isinstance(intake, EventIntake):
            facts.listeners.append(EventDiscovery(intake, unlisted))
        else:
            log.warning("kv_events.discover needs intake: thread; list the sources instead")
    tok = settings.tokenizer
    executor = tok.executor
    if executor == "auto":
        executor = "process" if tok.kind is TokenizerKind.HF else "thread"
    in_processes = executor == "process" and tok.kind is not TokenizerKind.NONE
    # With worker processes the gateway's own renderer is built only to check the
    # settings here (a bad tokenizer path fails at start-up, not in a worker).
    cache = make_cache(tok) if tok.kind is not TokenizerKind.NONE and not in_processes else None
    processes = (
        ProcessJobs(
            tok, settings.block_size, tok.workers, on_restart=metrics.tokenizer_restarts.inc
        )
        if in_processes
        else None
    )
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
        processes=processes,
        opening_held=evidence.holds_opening,
        opens_cold=evidence.opens_cold,
        adapter_of=AdapterNames(
            state.models, lambda m: state.resolve_model(m) if state.resolve_model else m
        ),
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
        intake: EventIntake | RemoteIntake,
        stage: TokenStage,
    ) -> None:
        self.index = index
        self.feed = feed
        self.bridge = bridge
        self.evidence = evidence
        self.intake = intake
        self.stage = stage
