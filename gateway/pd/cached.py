"""Which replica likely holds how much of a prompt: input to the `auto` decision.

The router's policy knows best when it keeps a prefix index; it shares it through the
`EstimatesCachedTokens` ability. Otherwise PD keeps its own small index, fed from request
outcomes (where each prompt was actually served), which is all the decision needs: a
sticky session's replica holds its earlier turns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from gateway.hashing import leading_match
from gateway.hooks import RequestOutcome
from gateway.policy import EstimatesCachedTokens, Policy
from gateway.types import ReplicaId, RouteRequest, SessionKey
from gateway.wrappers import walk

DEFAULT_BLOCKS_PER_REPLICA = 65_536
DEFAULT_SESSIONS = 100_000


def find_estimator(router: Policy) -> EstimatesCachedTokens | None:
    """The router, or a part it is made of (gateway.wrappers.walk), that estimates cached
    tokens."""
    for part in walk(router):
        if isinstance(part, EstimatesCachedTokens):
            return part
    return None


class ServedPrefixes:
    """Per replica, an LRU of the prompt blocks it recently served.

    Blocks of one prompt are touched deepest-first, so a prefix is always more recent than
    its extensions and eviction keeps each replica's set prefix-closed; the match length is
    then found by binary search. Memory: one dict entry per block; lookup O(log L).

    The gateway hashes only the first `max_prefix_blocks` of a prompt, far less than a
    100K-token agent context. When every hashed block matches, the session's previous turn
    on that replica (prompt + answer, as the engine reported them) says how much more is
    cached: a conversation's next turn repeats all of it.
    """

    def __init__(
        self,
        blocks_per_replica: int = DEFAULT_BLOCKS_PER_REPLICA,
        sessions: int = DEFAULT_SESSIONS,
    ) -> None:
        self.capacity = max(1, blocks_per_replica)
        self.session_capacity = max(1, sessions)
        self._lrus: dict[ReplicaId, OrderedDict[int, None]] = {}
        self._turns: OrderedDict[SessionKey, tuple[ReplicaId, int]] = OrderedDict()

    def record(self, replica: ReplicaId, hashes: Sequence[int]) -> None:
        lru = self._lrus.setdefault(replica, OrderedDict())
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def matched_blocks(self, replica: ReplicaId, hashes: Sequence[int]) -> int:
        lru = self._lrus.get(replica)
        return leading_match(hashes, lru) if lru else 0

    def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
        hashes = request.prefix_hashes
        blocks = self.matched_blocks(replica, hashes)
        tokens = blocks * request.block_tokens
        if hashes and blocks == len(hashes):
            turn = self._turns.get(request.session_key)
            if turn is not None and turn[0] == replica:
                tokens = max(tokens, turn[1])
        return tokens

    def observe(self, outcome: RequestOutcome) -> None:
        """`OutcomeObserver`: remember where a successful request's prompt now lives."""
        request, replica = outcome.request, outcome.replica
        if not outcome.ok or request is None or replica is None:
            return
        if request.prefix_hashes:
            self.record(replica, request.prefix_hashes)
        prompt = outcome.prompt_tokens or request.prompt_tokens
        turns = self._turns
        turns[request.session_key] = (replica, prompt + (outcome.completion_tokens or 0))
        turns.move_to_end(request.session_key)
        if len(turns) > self.session_capacity:
            turns.popitem(last=False)
