from __future__ import annotations

import pytest
from sample_third_party_policy import Reverse

from gateway.errors import ConfigError
from gateway.policy import PolicyContext
from gateway.routing import ComposedRouter, RoutingSettings, build_router
from gateway.types import ClusterView, EngineLoad, ReplicaId, ReplicaState, RouteRequest, SessionKey

NOW = 500.0


def replica(
    i: int,
    *,
    healthy: bool = True,
    models: frozenset[str] = frozenset(),
    waiting: float | None = 0.0,
) -> ReplicaState:
    load = (
        None
        if waiting is None
        else EngineLoad(waiting=waiting, running=0, kv_usage=0.1, scraped_at=NOW)
    )
    return ReplicaState(
        ReplicaId(f"r{i}"),
        f"http://127.0.0.1:{9100 + i}",
        healthy=healthy,
        models=models,
        load=load,
    )


def req(model: str = "m", session: str = "s") -> RouteRequest:
    return RouteRequest(
        request_id="q1",
        model=model,
        session_key=SessionKey(session),
        prefix_hashes=(1, 2, 3),
        block_tokens=16,
        prompt_tokens=48,
    )


def cview(*replicas: ReplicaState) -> ClusterView:
    return ClusterView(replicas=replicas, now=NOW, stale_after=2.0)


def router(policy: str, **kw: object) -> ComposedRouter:
    built = build_router(RoutingSettings.model_validate({"policy": policy, **kw}), PolicyContext())
    assert isinstance(built, ComposedRouter)
    return built


def test_unknown_policy_lists_known_names() -> None:
    with pytest.raises(ConfigError) as err:
        router("prefix_afinity")
    for known in ("round_robin", "least_load", "consistent_hash", "prefix_affinity"):
        assert known in err.value.message


def test_unknown_fallback_and_unknown_config_section_fail_at_start() -> None:
    with pytest.raises(ConfigError, match="known policies"):
        router("least_load", fallback="nope")
    with pytest.raises(ConfigError, match="known policies"):
        router("least_load", policies={"least_lod": {}})


def test_invalid_policy_config_names_the_section() -> None:
    with pytest.raises(ConfigError) as err:
        router("prefix_affinity", policies={"prefix_affinity": {"match_weigth": 2}})
    assert err.value.param == "routing.policies.prefix_affinity"


def test_unknown_filter_lists_known_filters() -> None:
    with pytest.raises(ConfigError) as err:
        router("least_load", filters=["healthy", "fast"])
    assert "not_saturated" in err.value.message and "serves_model" in err.value.message


def test_third_party_policy_loads_by_import_string() -> None:
    r = router(
        "sample_third_party_policy:Reverse",
        policies={"sample_third_party_policy:Reverse": {"label": "custom"}},
    )
    assert isinstance(r.scorer, Reverse)
    choice = r.choose(req(), cview(replica(0), replica(1), replica(2)))
    assert choice.ranked == ("r2", "r1", "r0") and choice.reason == "custom"


def test_abilities_are_forwarded_to_parts() -> None:
    r = router("sample_third_party_policy:Reverse", fallback="prefix_affinity")
    r.placed(req(), ReplicaId("r1"))
    r.membership_changed([replica(0), replica(1)])
    scorer = r.scorer
    assert isinstance(scorer, Reverse)
    assert scorer.placements == [("q1", "r1")] and scorer.memberships == [2]
    # The fallback (prefix_affinity) indexed the placement too.
    fallback = r.fallback
    assert fallback is not None and fallback.index.size(ReplicaId("r1")) == 3  # type: ignore[attr-defined]
    r.finished(req(), ReplicaId("r1"), True, 0.1)  # no part observes outcomes: a no-op


def test_fallback_answers_when_scorer_ranks_nothing() -> None:
    r = router("sample_third_party_policy:Nothing", fallback="least_load")
    choice = r.choose(req(), cview(replica(0, waiting=3), replica(1)))
    assert choice.first == "r1" and choice.policy == "least_load"


def test_drop_filters_remove_unhealthy_and_wrong_model() -> None:
    r = router("sample_third_party_policy:Reverse")
    v = cview(replica(0), replica(1, healthy=False), replica(2, models=frozenset({"other"})))
    assert r.choose(req("m"), v).ranked == ("r0",)
    assert r.choose(req("other"), v).ranked == ("r2", "r0")
    assert r.choose(req("m"), cview(replica(1, healthy=False))).ranked == ()


def test_saturated_and_unknown_replicas_are_demoted_not_dropped() -> None:
    r = router("sample_third_party_policy:Reverse", saturation={"max_waiting": 4})
    v = cview(replica(0), replica(1, waiting=None), replica(2, waiting=10))
    assert r.choose(req(), v).ranked == ("r0", "r2", "r1")
    stale = ReplicaState(ReplicaId("r3"), "http://x", load=EngineLoad(0, 0, scraped_at=NOW - 9))
    assert r.choose(req(), cview(replica(0), stale)).ranked == ("r0", "r3")
    # All saturated: the scorer's order stands.
    assert r.choose(req(), cview(replica(1, waiting=None), replica(2, waiting=10))).ranked == (
        "r2",
        "r1",
    )


def test_without_not_saturated_filter_order_is_the_scorers() -> None:
    r = router("sample_third_party_policy:Reverse", filters=["healthy"])
    v = cview(replica(0), replica(1, waiting=None))
    assert r.choose(req(), v).ranked == ("r1", "r0")


def test_narrowed_view_is_reused_per_snapshot() -> None:
    seen = []

    class Spy(Reverse):
        def choose(self, request: RouteRequest, view: ClusterView):  # type: ignore[no-untyped-def]
            seen.append(view.replicas)
            return super().choose(request, view)

    r = ComposedRouter(Spy(Reverse.Config(), PolicyContext()), filters=("healthy",))
    v = cview(replica(0), replica(1, healthy=False))
    r.choose(req(), v)
    r.choose(req(), v)
    assert seen[0] is seen[1] and len(seen[0]) == 1


@pytest.mark.parametrize(
    "name", ["round_robin", "consistent_hash", "least_load", "prefix_affinity"]
)
def test_every_builtin_composes(name: str) -> None:
    r = router(name)
    v = cview(replica(0), replica(1), replica(2))
    choice = r.choose(req(), v)
    assert set(choice.ranked) <= {"r0", "r1", "r2"} and choice.first is not None


def test_demotion_only_reorders_the_failover_head() -> None:
    from gateway.routing import FAILOVER_DEPTH

    r = router("sample_third_party_policy:Reverse", saturation={"max_waiting": 4})
    n = FAILOVER_DEPTH + 5
    replicas = [replica(i, waiting=10 if i == n - 1 else 0) for i in range(n)]
    ranked = r.choose(req(), cview(*replicas)).ranked
    # The scorer puts the saturated replica inside the head; it moves behind 16 fresh ones.
    assert ranked[FAILOVER_DEPTH] == f"r{n - 1}"
    assert len(ranked) == n and len(set(ranked)) == n


def test_cached_token_estimate_is_forwarded_only_when_a_part_has_one() -> None:
    from gateway.policy import EstimatesCachedTokens

    with_index = router("prefix_affinity")
    with_index.placed(req(), ReplicaId("r0"))
    assert isinstance(with_index, EstimatesCachedTokens)
    assert with_index.cached_tokens(req(), ReplicaId("r0")) == 48
    assert with_index.cached_tokens(req(), ReplicaId("r1")) == 0
    assert not isinstance(router("least_load"), EstimatesCachedTokens)
