"""`InFlight`: prompts sent to a replica whose requests have not finished yet.

The event-fed index only learns a prompt's blocks once the engine has computed them, and
the tokenizer stage needs a moment to map the prompt to them; a request that shares that
prompt meanwhile (the next turn of a conversation still decoding, another session with the
same preamble just sent) would otherwise see nothing anywhere and be placed at random.
The engine will hold the blocks of a request it is running (they are referenced until it
finishes, so they cannot be evicted) or about to run, so from dispatch to the end of the
request its prompt counts as cached there, in the gateway's own prompt-hash blocks.

Per replica a hash -> count of the in-flight prompts holding it. The hashes are chained, so
presence along one prompt is prefix-closed and a lookup is a binary search per replica.
Bounded: past `max_requests`, the oldest entries go (a request whose end was never seen).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from gateway.types import ReplicaId


class InFlight:
    def __init__(self, max_requests: int = 10_000) -> None:
        self.max_requests = max_requests
        self._requests: OrderedDict[str, tuple[ReplicaId, tuple[int, ...]]] = OrderedDict()
        self._held: dict[ReplicaId, dict[int, int]] = {}
        self.version = 0

    def __len__(self) -> int:
        return len(self._requests)

    def replicas(self) -> Iterable[ReplicaId]:
        return (r for r, held in self._held.items() if held)

    def dispatched(self, request_id: str, replica: ReplicaId, hashes: Sequence[int]) -> None:
        """`request_id` was sent to `replica` (a failover re-sends it: the last one counts)."""
        self.done(request_id)
        if not hashes:
            return
        prompt = tuple(hashes)
        self._requests[request_id] = (replica, prompt)
        held = self._held.setdefault(replica, {})
        for h in prompt:
            held[h] = held.get(h, 0) + 1
        self.version += 1
        while len(self._requests) > self.max_requests:
            self.done(next(iter(self._requests)))

    def done(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        replica, prompt = entry
        held = self._held[replica]
        for h in prompt:
            left = held[h] - 1
            if left:
                held[h] = left
            else:
                del held[h]
        self.version += 1

    def matched(self, replica: ReplicaId, hashes: Sequence[int], request_id: str = "") -> int:
        """Leading blocks of `hashes` that an in-flight prompt on `replica`, other than
        `request_id`'s own, shares."""
        held = self._held.get(replica)
        if not held or not hashes:
            return 0
        entry = self._requests.get(request_id)
        own: tuple[int, ...] = entry[1] if entry is not None and entry[0] == replica else ()

        def others(k: int) -> bool:
            h = hashes[k]
            # Chained hashes: the own prompt holds h only at the same position.
            return held.get(h, 0) > (1 if k < len(own) and own[k] == h else 0)

        if not others(0):
            return 0
        lo, hi = 1, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if others(mid - 1):
                lo = mid
            else:
                hi = mid - 1
        return lo
