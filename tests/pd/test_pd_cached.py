from __future__ import annotations

from gateway.hooks import RequestOutcome
from gateway.pd.cached import ServedPrefixes, find_estimator
from gateway.pd.colocated import ColocatedFirst
from gateway.types import (
    Choice,
    ClusterView,
    ReplicaId,
    ReplicaState,
    Role,
    RouteRequest,
    SessionKey,
)

A, B = ReplicaId("a"), ReplicaId("b")


def _req(hashes: tuple[int, ...], session: str = "s", prompt: int = 0) -> RouteRequest:
    return RouteRequest(
        request_id="r",
        model="m",
        session_key=SessionKey(session),
        prefix_hashes=hashes,
        block_tokens=16,
        prompt_tokens=prompt,
    )


def _done(
    request: RouteRequest,
    replica: ReplicaId,
    ok: bool = True,
    prompt: int | None = None,
    completion: int | None = None,
) -> RequestOutcome:
    return RequestOutcome(
        request=request,
        request_id="r",
        endpoint="chat",
        replica=replica,
        status=200 if ok else 500,
        ok=ok,
        stream=False,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


def test_matches_the_longest_served_prefix_per_replica() -> None:
    index = ServedPrefixes()
    index.observe(_done(_req((1, 2, 3)), A))
    assert index.cached_tokens(_req((1, 2, 3, 4), "other"), A) == 48
    assert index.cached_tokens(_req((1, 2, 9), "other"), A) == 32
    assert index.cached_tokens(_req((1, 2, 3)), B) == 0
    assert index.cached_tokens(_req((7,)), A) == 0


def test_failed_requests_are_not_indexed() -> None:
    index = ServedPrefixes()
    index.observe(_done(_req((1, 2)), A, ok=False))
    assert index.cached_tokens(_req((1, 2)), A) == 0


def test_eviction_keeps_prefixes_and_drops_tails() -> None:
    index = ServedPrefixes(blocks_per_replica=3)
    index.record(A, (1, 2, 3))
    index.record(A, (1, 2, 3, 4, 5))
    assert index.matched_blocks(A, (1, 2, 3, 4, 5)) == 3


def test_previous_turn_extends_the_estimate_past_the_hashed_blocks() -> None:
    index = ServedPrefixes()
    turn1 = _req((1, 2), prompt=50_000)
    index.observe(_done(turn1, A, prompt=50_200, completion=300))
    turn2 = _req((1, 2), prompt=52_000)
    assert index.cached_tokens(turn2, A) == 50_500
    # Not this session's replica, or the hashed part already differs: blocks only.
    assert index.cached_tokens(turn2, B) == 0
    assert index.cached_tokens(_req((1, 9), prompt=52_000), A) == 16


class _Estimating:
    name = "est"

    def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
        return Choice(tuple(r.id for r in view.replicas), "all")

    def cached_tokens(self, request: RouteRequest, replica: ReplicaId) -> int:
        return 5


def test_estimator_found_on_router_or_its_parts() -> None:
    inner = _Estimating()
    assert find_estimator(inner) is inner
    # A wrapper passes the ability through, bound to the inner router's own method.
    found = find_estimator(ColocatedFirst(inner))
    assert found is not None and found.cached_tokens == inner.cached_tokens

    class Plain:
        name = "plain"

        def choose(self, request: RouteRequest, view: ClusterView) -> Choice:
            return Choice((), "none")

    assert find_estimator(ColocatedFirst(Plain())) is None


def _replica(rid: str, role: Role, healthy: bool = True) -> ReplicaState:
    return ReplicaState(id=ReplicaId(rid), url="http://h:1", role=role, healthy=healthy)


def test_colocated_first_hides_pd_replicas_while_a_colocated_one_is_healthy() -> None:
    router = ColocatedFirst(_Estimating())
    view = ClusterView(
        replicas=(
            _replica("c0", Role.BOTH),
            _replica("p0", Role.PREFILL),
            _replica("d0", Role.DECODE),
        )
    )
    assert router.choose(_req((1,)), view).ranked == ("c0",)
    down = ClusterView(
        replicas=(_replica("c0", Role.BOTH, healthy=False), _replica("d0", Role.DECODE))
    )
    assert router.choose(_req((1,)), down).ranked == ("c0", "d0")
    only_pd = ClusterView(replicas=(_replica("p0", Role.PREFILL), _replica("d0", Role.DECODE)))
    assert router.choose(_req((1,)), only_pd).ranked == ("p0", "d0")


def test_colocated_first_with_a_custom_whole_request_rule() -> None:
    router = ColocatedFirst(_Estimating(), lambda r: r.role is not Role.PREFILL)
    view = ClusterView(
        replicas=(
            _replica("p0", Role.PREFILL),
            _replica("d0", Role.DECODE),
            _replica("d1", Role.DECODE),
        )
    )
    assert router.choose(_req((1,)), view).ranked == ("d0", "d1")
