"""Prometheus series of the KV event feed, the event-fed index and the tokenizer stage."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.kvevents.index import MEDIUM_NAMES, EventIndex, SyncState
from gateway.kvevents.tokcache import CacheStats
from gateway.metric_merge import MergeMode
from gateway.types import ReplicaId


class _IndexCollector(Collector):
    """Blocks per replica and medium, and each replica's sync state, read at scrape time."""

    # Workers: each subscribes to every engine's feed, so each holds the same index.
    merge_modes: ClassVar[Mapping[str, MergeMode]] = {
        "kvgate_kv_index_blocks": "max",
        "kvgate_kv_index_orphan_blocks": "max",
        "kvgate_kv_events_state": "latest",
    }

    def __init__(self, index: EventIndex, states: Callable[[], dict[ReplicaId, SyncState]]) -> None:
        self._index = index
        self._states = states

    def collect(self) -> Iterator[GaugeMetricFamily]:
        blocks = GaugeMetricFamily(
            "kvgate_kv_index_blocks",
            "Blocks the event-fed index holds",
            labels=["replica", "medium"],
        )
        orphans = GaugeMetricFamily(
            "kvgate_kv_index_orphan_blocks",
            "Stored blocks left out because their parent was unknown (since the last reset)",
            labels=["replica"],
        )
        state = GaugeMetricFamily(
            "kvgate_kv_events_state",
            "1 for the replica's current sync state",
            labels=["replica", "state"],
        )
        for rid in sorted(self._index.replicas()):
            r = self._index.blocks(rid)
            if r is None:
                continue
            for bit, name in MEDIUM_NAMES.items():
                if r.by_medium.get(bit):
                    blocks.add_metric([rid, name], r.by_medium[bit])
            orphans.add_metric([rid], r.orphans)
        for rid, current in sorted(self._states().items()):
            for s in SyncState:
                state.add_metric([rid, s.value], 1.0 if s is current else 0.0)
        yield blocks
        yield orphans
        yield state

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


class KVEventMetrics:
    """Registered on the app's registry (never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.batches = Counter(
            "kvgate_kv_events_batches", "Event batches applied", ["replica"], registry=r
        )
        self.events = Counter("kvgate_kv_events", "Events applied", ["replica", "type"], registry=r)
        self.gaps = Counter("kvgate_kv_events_gaps", "Sequence gaps seen", ["replica"], registry=r)
        self.missed = Counter(
            "kvgate_kv_events_missed_batches",
            "Batches lost in sequence gaps",
            ["replica"],
            registry=r,
        )
        self.resyncs = Counter(
            "kvgate_kv_events_resyncs",
            "Index restarts and replays, by cause and outcome",
            ["replica", "reason"],
            registry=r,
        )
        self.malformed_total = Counter(
            "kvgate_kv_events_malformed",
            "Messages that could not be decoded",
            ["replica"],
            registry=r,
        )
        self.disconnects = Counter(
            "kvgate_kv_events_disconnects", "Publisher connections lost", ["replica"], registry=r
        )
        self.lag = Gauge(
            "kvgate_kv_events_lag_seconds",
            "Publisher timestamp to applied, last batch (wall clocks of two hosts)",
            ["replica"],
            multiprocess_mode="livemax",
            registry=r,
        )
        self.lag_hist = Histogram(
            "kvgate_kv_events_lag",
            "Publisher timestamp to applied, per batch (seconds)",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=r,
        )
        self.evidence = Counter(
            "kvgate_kv_evidence_lookups",
            "Routing lookups answered from events (precise) or left to the approximate index",
            ["outcome"],
            registry=r,
        )
        self.tokenize = Counter(
            "kvgate_kv_tokenize_jobs",
            "Prompts handed to the tokenizer stage, by outcome",
            ["outcome"],
            registry=r,
        )
        self.tokenizer_restarts = Counter(
            "kvgate_kv_tokenizer_restarts",
            "Tokenizer worker processes started again after they exited",
            registry=r,
        )
        self.intake_restarts = Counter(
            "kvgate_kv_intake_restarts",
            "KV event intake processes started again after they exited",
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "kvgate_kv_tokenize_seconds",
            "Tokenizer stage time per prompt (in its worker thread or process)",
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0),
            registry=r,
        )
        self.route_waits = Counter(
            "kvgate_kv_route_waits",
            "Routing decisions and the tokenizer stage: in_time (learnt before the decision), "
            "cold (its first token block on no synced replica: routed once that was known), "
            "over_budget, cancelled (the client left), known (the bridge knew the prompt), "
            "queue_full, unsynced (no replica's events to look it up in)",
            ["outcome"],
            registry=r,
        )
        self.route_wait_seconds = Histogram(
            "kvgate_kv_route_wait_seconds",
            "Time a routing decision waited for its prompt's tokenization",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1),
            registry=r,
        )
        self.bridge_entries = Gauge(
            "kvgate_kv_bridge_entries",
            "Prompt blocks mapped to engine token blocks",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.token_cache_lookups = Counter(
            "kvgate_kv_token_cache_lookups",
            "Rendered prompts looked up in the token cache: hit (extended incrementally), "
            "miss, fallback (overlap disagreed, tokenized whole)",
            ["outcome"],
            registry=r,
        )
        self.token_cache_reused = Counter(
            "kvgate_kv_token_cache_reused_tokens",
            "Leading tokens taken from the token cache instead of tokenized again",
            registry=r,
        )
        self.token_cache_entries = Gauge(
            "kvgate_kv_token_cache_entries",
            "Tokenized rendered prompts the token cache holds",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.token_cache_bytes = Gauge(
            "kvgate_kv_token_cache_bytes",
            "Approximate memory of the token cache",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.token_cache_evictions = Gauge(
            "kvgate_kv_token_cache_evictions",
            "Entries the token cache dropped for its bounds (since start)",
            multiprocess_mode="livesum",
            registry=r,
        )
        self._registry = registry

    def token_cache(self, outcome: str, reused: int, stats: CacheStats | None) -> None:
        """One token cache lookup; `stats`: the size of the cache that answered it (a
        worker process's, when the tokenizer runs in processes)."""
        self.token_cache_lookups.labels(outcome).inc()
        if reused:
            self.token_cache_reused.inc(reused)
        if stats is not None:
            self.token_cache_entries.set(stats.entries)
            self.token_cache_bytes.set(stats.bytes)
            self.token_cache_evictions.set(stats.evictions)

    def watch(self, index: EventIndex, states: Callable[[], dict[ReplicaId, SyncState]]) -> None:
        self._registry.register(_IndexCollector(index, states))

    def batch(
        self, replica: ReplicaId, stored: int, removed: int, cleared: int, lag: float
    ) -> None:
        self.batches.labels(replica).inc()
        if stored:
            self.events.labels(replica, "BlockStored").inc(stored)
        if removed:
            self.events.labels(replica, "BlockRemoved").inc(removed)
        if cleared:
            self.events.labels(replica, "AllBlocksCleared").inc(cleared)
        self.lag.labels(replica).set(lag)
        self.lag_hist.observe(lag)

    def resync(self, replica: ReplicaId, reason: str) -> None:
        self.resyncs.labels(replica, reason).inc()

    def gap(self, replica: ReplicaId, missed: int) -> None:
        self.gaps.labels(replica).inc()
        self.missed.labels(replica).inc(missed)

    def malformed(self, replica: ReplicaId) -> None:
        self.malformed_total.labels(replica).inc()

    def connection(self, replica: ReplicaId, up: bool) -> None:
        if not up:
            self.disconnects.labels(replica).inc()
