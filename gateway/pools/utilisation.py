"""Per-pool utilisation from a cluster view: the one load figure the selector and the
controller share. Pure.

A replica's utilisation is the largest of its gateway in-flight count, its scraped
running + waiting sequences (both per slot) and its scraped KV occupancy. In-flight is
always fresh, so a pool whose scrape went stale still reads as busy when it is.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.pools.config import DEFAULT_SLOTS_PER_REPLICA, PoolSpec
from gateway.types import ClusterView, ReplicaState


def replica_utilisation(replica: ReplicaState, view: ClusterView, slots: int) -> float:
    util = view.inflight(replica.id) / slots
    load = view.load_of(replica)
    if load is not None:
        util = max(util, (load.running + load.waiting) / slots)
        if load.kv_usage is not None:
            util = max(util, load.kv_usage)
    return util


def pool_utilisation(view: ClusterView, specs: Mapping[str, PoolSpec]) -> dict[str, float | None]:
    """Mean utilisation of each configured pool's healthy replicas; None when it has none."""
    totals: dict[str, list[float]] = {name: [] for name in specs}
    for replica in view.replicas:
        if not replica.healthy or replica.pool not in totals:
            continue
        spec = specs[replica.pool]
        slots = spec.slots_per_replica if spec else DEFAULT_SLOTS_PER_REPLICA
        totals[replica.pool].append(replica_utilisation(replica, view, slots))
    return {name: (sum(v) / len(v) if v else None) for name, v in totals.items()}
