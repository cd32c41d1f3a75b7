"""`EventEvidence`: the `CacheEvidence` routing reads (gateway.types), from the bridge, the
event-fed index and each replica's sync state.

Precise answers only: a replica is in the answer when its stream is synced (nothing lost
since a known-empty cache); it is left to the approximate index while warming or down,
and so is every replica while the prompt's token blocks are not known yet. The answer is
memoised per request, since a policy, admission and PD may each ask.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import MEDIUM_BITS, EventIndex, SyncState
from gateway.kvevents.metrics import KVEventMetrics
from gateway.types import ReplicaId, RouteRequest


def weights_by_bit(weights: Mapping[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for name, w in weights.items():
        bit = MEDIUM_BITS.get(name, 8)
        out[bit] = max(out.get(bit, 0.0), w)
    return out


class EventEvidence:
    def __init__(
        self,
        index: EventIndex,
        feed: EventFeed,
        bridge: PromptBridge,
        medium_weights: Mapping[str, float],
        metrics: KVEventMetrics | None = None,
        *,
        block_size: int = 16,
    ) -> None:
        self.block_size = block_size
        self.index = index
        self.feed = feed
        self.bridge = bridge
        self.weights = weights_by_bit(medium_weights)
        self.metrics = metrics
        self._memo: tuple[str, int, Mapping[ReplicaId, int] | None] = ("", -1, None)

    def cached_tokens(self, request: RouteRequest) -> Mapping[ReplicaId, int] | None:
        rid, version, answer = self._memo
        if rid == request.request_id and version == self.index.version and rid:
            return answer
        answer = self._lookup(request)
        self._memo = (request.request_id, self.index.version, answer)
        if self.metrics is not None:
            self.metrics.evidence.labels("approximate" if answer is None else "precise").inc()
        return answer

    def _lookup(self, request: RouteRequest) -> Mapping[ReplicaId, int] | None:
        hashes = request.prefix_hashes
        if not hashes:
            return None
        known = self.bridge.lookup(hashes)
        if known is None:
            return None
        keys, n = known
        chain = keys[:n] if n < len(keys) else keys
        out: dict[ReplicaId, int] = {}
        state, matched, blocks = self.feed.state, self.index.matched, self.index.blocks
        for replica in list(self.index.replicas()):
            if state(replica) is not SyncState.SYNCED:
                continue
            r = blocks(replica)
            if r is not None and r.block_size and r.block_size != self.block_size:
                continue  # keyed with another block size: these keys cannot match
            _, weighed = matched(replica, chain, self.weights)
            out[replica] = int(weighed * self.block_size)
        return out or None
