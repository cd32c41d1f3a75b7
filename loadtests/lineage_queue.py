"""Issue 45's rag candidate for `bench_lineage.py`: `lineage` whose new sessions leave
their best-cached replica when its queued prefill passes what the prefix saves there.

`kvgate-loadtests.lineage_queue:LineageQueue` runs it beside the default `kvgate`. A new
session (not sticky, not moved) whose prompt's branch point is not hot, and whose
best-cached replica has more uncached prefill pending (sent, no first token yet) than the
tokens it holds of the prompt, is ranked by queued plus own uncached prefill, in seconds at
each replica's measured prefill speed. Otherwise `lineage` decides. Offline (docs/routing.md,
2026-12-06 second) it improved rag on 3 seeds and cost forks' children hit.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import ClassVar

from gateway.policy import RANK_DEPTH
from gateway.types import Choice, ClusterView, ReplicaId, RouteRequest
from plugins.lineage import Lineage
from plugins.load_model import mix


class LineageQueue(Lineage):
    name: ClassVar[str] = "lineage_queue"

    def _place(
        self,
        request: RouteRequest,
        view: ClusterView,
        unit: float,
        moved: str,
        avoid: ReplicaId | None = None,
    ) -> Choice:
        if not moved and request.prefix_hashes:
            choice = self._by_seconds(request, view)
            if choice is not None:
                return choice
        return super()._place(request, view, unit, moved, avoid)

    def _by_seconds(self, request: RouteRequest, view: ClusterView) -> Choice | None:
        prefill = view.prefill
        if prefill is None or prefill.mean_speed() is None:
            return None
        replicas = view.replicas
        hashes = request.prefix_hashes
        position = {r.id: i for i, r in enumerate(replicas)}
        matched = self.index.matched_sparse(position, hashes)
        if not matched:
            return None
        depth = max(matched.values())
        if self._branches.get(hashes[depth - 1], 0) >= self.config.hot_after:
            return None  # a hot preamble: the band decides
        precise: Mapping[ReplicaId, int] | None = None
        if self._evidence is not None:
            precise = self._precise(self._evidence, request)
        prompt, bt = request.prompt_tokens, request.block_tokens or 1
        cached = [
            min(prompt, precise[r.id])
            if precise is not None and r.id in precise
            else min(prompt, matched.get(i, 0) * bt)
            for i, r in enumerate(replicas)
        ]
        best = max(cached)
        if best <= 0:
            return None
        pending = self._pending.get
        if pending(replicas[cached.index(best)].id, 0.0) <= best:
            return None
        sh, rh, speed = (
            self._tie.session_hash(request.session_key),
            self._tie.replica_hash,
            prefill.speed,
        )
        keys = [
            ((pending(r.id, 0.0) + prompt - cached[i]) / (speed(r.id) or 1.0), mix(sh, rh(r.id)), i)
            for i, r in enumerate(replicas)
        ]
        top = heapq.nsmallest(RANK_DEPTH, keys) if len(keys) > RANK_DEPTH else sorted(keys)
        return Choice(tuple(replicas[i].id for _, _, i in top), "queued", self.name)
