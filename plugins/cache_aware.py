"""`cache_aware`: the rule the Rust routers (SGLang's and vLLM's) call `cache_aware`, for
comparing kvgate's default against it on the same index, engines and traces, offline
(`kvgate simulate`, loadtests/bench_windows.py) or live, and for operators moving from
those routers who want their old behaviour first.

Per request, over the candidates:

* **Imbalanced** when the largest count of requests in flight from this gateway exceeds
  the smallest by more than ``balance_abs_threshold`` *and* is more than
  ``balance_rel_threshold`` times it: the request goes to the fewest in flight.
* Otherwise, if the replica holding the longest prefix of the prompt holds more than
  ``cache_threshold`` of it, the request goes there, however loaded it is.
* Otherwise (a new prompt) it goes to the fewest in flight.

Ties among the least loaded go to the replica that was sent the fewest requests, then by
a hash of the session key. What each replica holds is this gateway's prefix index of the
prompts sent there (`PrefixIndex`, LRU sized from each replica's KV, like `lineage`'s);
the Rust routers keep a character tree per worker bounded in size and trimmed on a timer,
so their view of an evicted prefix lasts longer or shorter than this one.

No session memory and no load bound: a conversation stays only while its cache wins, which
is what the comparison is for. Cost: O(n log n) per request (the load order) plus the
index's match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from gateway.policy import RANK_DEPTH, PolicyConfig, PolicyContext
from gateway.types import Choice, ClusterView, ReplicaId, ReplicaState, RouteRequest
from plugins.load_model import TieBreaker, mix
from plugins.prefix_index import DEFAULT_CAPACITY_TOKENS, PrefixIndex


class CacheAwareConfig(PolicyConfig):
    cache_threshold: float = Field(
        default=0.3,
        ge=0,
        le=1,
        description="share of the prompt the best replica must hold for the cache to decide",
    )
    balance_abs_threshold: int = Field(
        default=64, ge=0, description="in-flight spread (max - min) above which load decides"
    )
    balance_rel_threshold: float = Field(
        default=1.5, ge=1, description="and max over min above which load decides"
    )
    default_capacity_tokens: int = Field(
        default=DEFAULT_CAPACITY_TOKENS, ge=1, description="KV capacity when not scraped"
    )
    index_capacity_factor: float = Field(
        default=4.0, gt=0, description="prefix index size per replica vs its KV"
    )


class CacheAware:
    name: ClassVar[str] = "cache_aware"
    Config: ClassVar[type[CacheAwareConfig]] = CacheAwareConfig

    def __init__(self, config: CacheAwareConfig, context: PolicyContext) -> None:
        self.config = config
        self.index = PrefixIndex(config.default_capacity_tokens, config.index_capacity_factor)
        self._tie = TieBreaker()
        self._served: dict[ReplicaId, int] = {}
        self._block_tokens = 16
        self._view_key: tuple[ReplicaState, ...] | None = None
        self.membership_changed(context.replicas)

    def membership_changed(self, replicas: Sequence[ReplicaState]) -> None:
        live = {r.id for r in replicas}
        for gone in set(self._served) - live:
            self.index.forget(gone)
            del self._served[gone]
        for r in replicas:
            self._served.setdefault(r.id, 0)
            self._fit(r)

    def _fit(self, r: ReplicaState) -> None:
        capacity = (r.load.kv_capacity_tokens if r.load is not None else None) or (
            r.kv_capacity_tokens
        )
        if capacity:
            self.index.set_capacity(r.id, capacity, self._block_tokens)

    def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
        if not request.prefix_hashes:
            return 0
        tokens = self.index.matched(replica, request.prefix_hashes) * request.block_tokens
        return min(tokens, request.prompt_tokens) if request.prompt_tokens else tokens

    def placed(self, request: RouteRequest, replica: ReplicaId) -> None:
        self._served[replica] = self._served.get(replica, 0) + 1
        if request.prefix_hashes:
            self._block_tokens = request.block_tokens or 1
            self.index.record(replica, request.prefix_hashes, self._block_tokens)

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        replicas = view.replicas
        if not replicas:
            return Choice((), "no_candidates", self.name)
        if replicas is not self._view_key:  # scraped KV capacities size the index
            self._view_key = replicas
            for r in replicas:
                self._fit(r)
        inflight, served = view.in_flight.get, self._served.get
        sh = self._tie.session_hash(request.session_key)
        rh = self._tie.replica_hash
        keys = sorted(
            (inflight(r.id, 0), served(r.id, 0), mix(sh, rh(r.id)), i)
            for i, r in enumerate(replicas)
        )
        order = [k[3] for k in keys]
        cfg = self.config
        low, high = keys[0][0], keys[-1][0]
        if high - low > cfg.balance_abs_threshold and high > cfg.balance_rel_threshold * low:
            return self._ranked(replicas, order, "imbalanced")
        best = self._best_match(request, replicas, order)
        if best is None:
            return self._ranked(replicas, order, "least_load")
        order.remove(best)
        order.insert(0, best)
        return self._ranked(replicas, order, "prefix")

    def _ranked(self, replicas: Sequence[ReplicaState], order: list[int], reason: str) -> Choice:
        return Choice(tuple(replicas[i].id for i in order[:RANK_DEPTH]), reason, self.name)

    def _best_match(
        self, request: RouteRequest, replicas: Sequence[ReplicaState], order: list[int]
    ) -> int | None:
        """The replica holding the longest prefix (the least loaded of those holding as
        much), if it holds more than the threshold of the prompt."""
        hashes = request.prefix_hashes
        if not hashes or not request.prompt_tokens:
            return None
        position = {r.id: i for i, r in enumerate(replicas)}
        matched = self.index.matched_sparse(position, hashes)
        if not matched:
            return None
        blocks = max(matched.values())
        share = blocks * (request.block_tokens or 1) / request.prompt_tokens
        if share <= self.config.cache_threshold:
            return None
        return next(i for i in order if matched.get(i, 0) == blocks)
