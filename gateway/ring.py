"""Consistent-hash ring with virtual nodes, per-replica weights and bounded load.

Build once per membership change (O(V·N log(V·N)) for V virtual nodes per unit weight and N
replicas); look up in O(log(V·N)) plus a short walk. The ring stores only positions and
replica ids; health and load are passed in per lookup, so a replica that goes down keeps
its positions and gets its keys back when it recovers.

Bounded load (consistent hashing with bounded loads): with `total` requests in flight over
the eligible replicas, replica r may take a new request only while
``in_flight[r] + 1 <= ceil(factor * (total + 1) * weight[r] / sum(weights))``;
otherwise the request passes to the next replica clockwise.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat

from gateway.hashing import hash_key, vnode_hash
from gateway.types import ReplicaId

DEFAULT_VNODES = 160
DEFAULT_LOAD_FACTOR = 1.25


@dataclass(frozen=True, slots=True)
class RingNode:
    id: ReplicaId
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class RingLookup:
    ranked: list[ReplicaId]
    owner: ReplicaId | None  # the key's replica on the full ring, eligible or not
    first_eligible: ReplicaId | None  # the first eligible replica before the load bound

    @property
    def reason(self) -> str:
        if not self.ranked:
            return "no_candidates"
        if self.ranked[0] != self.first_eligible:
            return "bounded_load"
        if self.first_eligible != self.owner:
            return "failover"
        return "ring"


class HashRing:
    """Immutable ring over a set of weighted replicas."""

    __slots__ = ("_owners", "_positions", "_weights", "vnodes")

    def __init__(self, nodes: Iterable[RingNode], vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        points: list[tuple[int, str]] = []
        weights: dict[ReplicaId, float] = {}
        for node in nodes:
            if node.weight < 0 or not math.isfinite(node.weight):
                raise ValueError(f"replica {node.id!r}: weight must be a finite number >= 0")
            if node.id in weights:
                raise ValueError(f"replica {node.id!r} appears twice")
            weights[node.id] = node.weight
            count = max(1, round(vnodes * node.weight)) if node.weight > 0 else 0
            points.extend((vnode_hash(node.id, i), node.id) for i in range(count))
        # Ties between equal positions (vanishingly rare) are broken by id, not input order.
        points.sort()
        self._positions = [p for p, _ in points]
        self._owners = [ReplicaId(o) for _, o in points]
        self._weights = weights

    def __len__(self) -> int:
        return len(self._weights)

    @property
    def members(self) -> Mapping[ReplicaId, float]:
        return self._weights

    def shares(self) -> dict[ReplicaId, float]:
        """Fraction of the key space each replica owns (its arcs of the ring); sums to 1.

        O(V·N). A key hashes to the first position at or after it, so each position owns
        the arc back to the previous one (the first wraps around from the last).
        """
        positions, owners = self._positions, self._owners
        out = dict.fromkeys(self._weights, 0.0)
        if not positions:
            return out
        span = float(1 << 64)
        previous = positions[-1] - (1 << 64)
        for position, owner in zip(positions, owners):
            out[owner] += (position - previous) / span
            previous = position
        return out

    def clockwise(self, key: str | bytes) -> Iterator[ReplicaId]:
        """Ring owners clockwise from the key's position, lazily (repeats included)."""
        positions = self._positions
        total = len(positions)
        if not total:
            return
        start = bisect_left(positions, hash_key(key))
        owners = self._owners
        for step in range(total):
            yield owners[(start + step) % total]

    def first(self, key: str | bytes, accept: Container[ReplicaId]) -> ReplicaId | None:
        """The first replica clockwise that `accept` contains: O(log n) plus a short walk."""
        for owner in self.clockwise(key):
            if owner in accept:
                return owner
        return None

    def walk(self, key: str | bytes) -> list[ReplicaId]:
        """Every distinct replica in clockwise order from the key's position."""
        want = sum(1 for w in self._weights.values() if w > 0)
        seen: list[ReplicaId] = []
        seen_set: set[ReplicaId] = set()
        for owner in self.clockwise(key):
            if owner not in seen_set:
                seen_set.add(owner)
                seen.append(owner)
                if len(seen) == want:
                    break
        return seen

    def lookup(
        self,
        key: str | bytes,
        *,
        eligible: Callable[[ReplicaId], bool] | None = None,
        in_flight: Mapping[ReplicaId, int] | None = None,
        load_factor: float | None = DEFAULT_LOAD_FACTOR,
        members: Collection[ReplicaId] | None = None,
        depth: int | None = None,
    ) -> RingLookup:
        """Eligible replicas in preference order, plus the key's owner for reason reporting.

        Under-limit replicas come first in ring order, then over-limit ones in ring order
        (so a fully saturated cluster still fails over instead of refusing).

        With `members` (exactly the eligible replicas, each a member of positive weight;
        it then replaces `eligible`) and
        `depth`, the walk stops once `depth` under-limit replicas are found: the head of the
        ranking is the same as the full one's, the tail is left out, and the cost is
        O(log(V·N)) plus a short walk (and one C-level sum of the in-flight counts).
        """
        if depth is not None and members is not None:
            return self._lookup_head(key, members, in_flight, load_factor, depth)
        walked = self.walk(key)
        owner = walked[0] if walked else None
        order = walked if eligible is None else [r for r in walked if eligible(r)]
        first = order[0] if order else None
        if not order or load_factor is None or in_flight is None:
            return RingLookup(order, owner, first)
        weights = self._weights
        total = sum(in_flight.get(r, 0) for r in order)
        weight_sum = sum(weights[r] for r in order)
        under: list[ReplicaId] = []
        over: list[ReplicaId] = []
        for r in order:
            limit = math.ceil(load_factor * (total + 1) * weights[r] / weight_sum)
            (under if in_flight.get(r, 0) + 1 <= limit else over).append(r)
        return RingLookup(under + over, owner, first)

    def _lookup_head(
        self,
        key: str | bytes,
        members: Collection[ReplicaId],
        in_flight: Mapping[ReplicaId, int] | None,
        load_factor: float | None,
        depth: int,
    ) -> RingLookup:
        positions, owners, weights = self._positions, self._owners, self._weights
        size = len(positions)
        want = len(members)
        if not size or not want:
            return RingLookup([], owners[0] if size else None, None)
        start = bisect_left(positions, hash_key(key))
        owner = owners[start % size]
        bounded = load_factor is not None and in_flight is not None
        scale = 0.0
        if bounded:
            assert in_flight is not None and load_factor is not None
            get = in_flight.get
            total = sum(map(get, members, repeat(0)))
            weight_sum = sum(map(weights.__getitem__, members))
            scale = load_factor * (total + 1)
        under: list[ReplicaId] = []
        over: list[ReplicaId] = []
        seen: set[ReplicaId] = set()
        ceil = math.ceil
        first: ReplicaId | None = None
        for step in range(size):
            r = owners[(start + step) % size]
            if r in seen or r not in members:
                continue
            if first is None:
                first = r
            seen.add(r)
            # Same expression as the full lookup, so both agree to the last bit.
            if not bounded or get(r, 0) + 1 <= ceil(scale * weights[r] / weight_sum):
                under.append(r)
                if len(under) >= depth:
                    break
            else:
                over.append(r)
            if len(seen) == want:
                break
        return RingLookup(under + over, owner, first)
