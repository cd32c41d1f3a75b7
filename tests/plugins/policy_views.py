"""Hand-built cluster views for policy unit tests (pure data, no servers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.types import ClusterView, EngineLoad, ReplicaId, ReplicaState, RouteRequest, SessionKey

NOW = 1000.0


def rid(i: int) -> ReplicaId:
    return ReplicaId(f"r{i}")


def replicas(n: int, **kw: object) -> tuple[ReplicaState, ...]:
    return tuple(
        ReplicaState(id=rid(i), url=f"http://127.0.0.1:{9000 + i}", **kw) for i in range(n)
    )  # type: ignore[arg-type]


def load(
    waiting: float = 0,
    running: float = 0,
    kv: float | None = 0.1,
    age: float = 0.0,
    capacity: int | None = None,
) -> EngineLoad:
    return EngineLoad(
        waiting=waiting,
        running=running,
        kv_usage=kv,
        kv_capacity_tokens=capacity,
        scraped_at=NOW - age,
    )


def view(
    states: Sequence[ReplicaState],
    loads: Mapping[int, EngineLoad | None] | None = None,
    inflight: Mapping[int, int] | None = None,
    *,
    default_load: EngineLoad | None = None,
) -> ClusterView:
    """Replicas r0..rN with the given per-index loads (default: idle, fresh)."""
    base = default_load if default_load is not None else load()
    built = []
    for i, r in enumerate(states):
        lo = base if loads is None or i not in loads else loads[i]
        built.append(
            ReplicaState(
                r.id, r.url, r.weight, r.healthy, r.models, r.pool, r.role, lo, r.kv_capacity_tokens
            )
        )
    return ClusterView(
        replicas=tuple(built),
        now=NOW,
        stale_after=2.0,
        in_flight={rid(i): n for i, n in (inflight or {}).items()},
    )


def request(
    session: str, hashes: Sequence[int] = (), block_tokens: int = 16, model: str = "m"
) -> RouteRequest:
    return RouteRequest(
        request_id=f"req-{session}",
        model=model,
        session_key=SessionKey(session),
        prefix_hashes=tuple(hashes),
        block_tokens=block_tokens,
        prompt_tokens=len(hashes) * block_tokens,
    )
