"""`EventEvidence`: the `CacheEvidence` routing reads (gateway.types), from the bridge, the
event-fed index, the prompts in flight and each replica's sync state.

Per synced replica (nothing lost since a known-empty cache), the tokens it holds of the
prompt by its events, or will hold by the time it runs the request: the part another
request in flight there shares (`InFlight`), whose blocks its events have not shown yet.
A replica warming or down is left to the approximate index, and so is every replica while
neither the bridge nor an in-flight prompt knows the prompt. The answer is memoised per
request, since a policy, admission and PD may each ask.

It is also the dispatch observer and outcome observer that keep `InFlight` (install.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from gateway.hooks import RequestOutcome
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import MEDIUM_BITS, EventIndex, ReplicaBlocks, SyncState
from gateway.kvevents.inflight import InFlight
from gateway.kvevents.intake import replica_of
from gateway.kvevents.metrics import KVEventMetrics
from gateway.types import ReplicaId, RouteRequest

_MAX_COLD = 4096  # marks of requests that never finished (bounded: the outcome drops them)


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
        inflight: InFlight | None = None,
    ) -> None:
        self.block_size = block_size
        self.index = index
        self.feed = feed
        self.bridge = bridge
        self.inflight = inflight if inflight is not None else InFlight()
        self.weights = weights_by_bit(medium_weights)
        self.metrics = metrics
        self._memo: tuple[str, int, int, Mapping[ReplicaId, int] | None] = ("", -1, -1, None)
        # Requests whose prompt opens with a block no synced replica holds (the tokenizer
        # stage's early answer, before the bridge knows the prompt), until they finish.
        self._cold: OrderedDict[str, None] = OrderedDict()

    # -- observers (install.py) ------------------------------------------------------------
    def dispatched(
        self, request: RouteRequest, replica: ReplicaId, body: Mapping[str, Any]
    ) -> None:
        self.inflight.dispatched(request.request_id, replica, request.prefix_hashes)

    def finished(self, outcome: RequestOutcome) -> None:
        self.inflight.done(outcome.request_id)
        self._cold.pop(outcome.request_id, None)

    def _answering(self) -> Iterator[tuple[ReplicaId, ReplicaBlocks | None]]:
        """The replicas whose events can answer for keys of this block size: synced, and
        not keyed with another block size (those keys cannot match)."""
        state, blocks = self.feed.state, self.index.blocks
        for replica in list(self.index.replicas()):
            if state(replica) is not SyncState.SYNCED:
                continue
            r = blocks(replica)
            if r is None or not r.block_size or r.block_size == self.block_size:
                yield replica, r

    def holds_opening(self, key: int) -> bool:
        """Whether a synced replica's events show the token block keyed `key`."""
        return any(r is not None and key in r.media for _, r in self._answering())

    def opens_cold(self, request_id: str) -> None:
        """The request's first token block is on no synced replica, so none of its prompt
        is: its lookup answers so (zeros) without the rest of its tokens."""
        self._cold[request_id] = None
        if len(self._cold) > _MAX_COLD:
            self._cold.popitem(last=False)

    # -- CacheEvidence ---------------------------------------------------------------------
    def cached_tokens(self, request: RouteRequest) -> Mapping[ReplicaId, int] | None:
        rid, version, flying, answer = self._memo
        if (
            rid == request.request_id
            and version == self.index.version
            and flying == self.inflight.version
            and rid
        ):
            return answer
        answer = self._lookup(request)
        self._memo = (request.request_id, self.index.version, self.inflight.version, answer)
        if self.metrics is not None:
            self.metrics.evidence.labels("approximate" if answer is None else "precise").inc()
        return answer

    def _lookup(self, request: RouteRequest) -> Mapping[ReplicaId, int] | None:
        hashes = request.prefix_hashes
        if not hashes:
            return None
        out: dict[ReplicaId, int] = {}
        state = self.feed.state
        known = self.bridge.lookup(hashes)
        if known is not None:
            keys, n = known
            chain = keys[:n] if n < len(keys) else keys
            matched = self.index.matched
            for stream, _ in self._answering():
                _, weighed = matched(stream, chain, self.weights)
                # A data-parallel replica's ranks are streams of their own: the request runs
                # on one rank, so the replica holds what its best rank holds.
                replica = replica_of(stream)
                tokens = int(weighed * self.block_size)
                if tokens >= out.get(replica, 0):
                    out[replica] = tokens
        elif request.request_id in self._cold:
            # What the whole prompt's keys would give: no block of it on any synced replica.
            out.update((replica_of(stream), 0) for stream, _ in self._answering())
        inflight, bt = self.inflight, request.block_tokens
        for replica in list(inflight.replicas()):
            n = inflight.matched(replica, hashes, request.request_id)
            if n and state(replica) is SyncState.SYNCED and n * bt > out.get(replica, 0):
                out[replica] = n * bt
        return out or None
