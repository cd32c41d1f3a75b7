from __future__ import annotations

import pytest
from pools_helpers import FP4_MODEL, MODEL, cluster, replica, settings, two_pools

from gateway.errors import ModelNotFound, NoHealthyReplica
from gateway.pools.placement import ContextTooLong, Placement


def test_alias_resolves_to_served_model_and_its_pools() -> None:
    p = Placement(settings())
    target = p.resolve("deepseek")
    assert target is not None
    assert (target.requested, target.served, target.pools) == ("deepseek", FP4_MODEL, {"h200"})
    glm = p.resolve("glm")
    assert glm is not None and glm.served == MODEL and glm.pools == {"h200", "domestic"}


def test_capability_constraint_excludes_pools_even_when_they_serve_the_model() -> None:
    target, candidates = Placement(settings()).place("deepseek", two_pools())
    assert target.served == FP4_MODEL
    assert {r.pool for r in candidates} == {"h200"}


def test_unlisted_model_may_go_anywhere_unless_strict() -> None:
    view = cluster(replica("a", "h200", models=("other",)), replica("b", None, models=("other",)))
    _, candidates = Placement(settings()).place("other", view)
    assert [r.id for r in candidates] == ["a", "b"]
    with pytest.raises(ModelNotFound, match="'other' does not exist") as err:
        Placement(settings(strict_models=True)).place("other", view)
    assert err.value.status == 404 and err.value.param == "model"


def test_model_nobody_serves_is_404_naming_the_model() -> None:
    with pytest.raises(ModelNotFound, match="'ghost'"):
        Placement(settings()).place("ghost", two_pools())


def test_known_model_without_healthy_capable_replica_is_503_naming_it() -> None:
    view = cluster(
        replica("h", "h200", healthy=False),
        replica("d1", "domestic"),
        replica("d2", "domestic"),
    )
    with pytest.raises(NoHealthyReplica, match="pools h200 can serve model 'deepseek'") as err:
        Placement(settings()).place("deepseek", view)
    assert err.value.status == 503 and "retry-after" in err.value.headers


def test_replicas_not_serving_the_model_are_excluded() -> None:
    view = cluster(replica("h", "h200", models=("x",)), replica("d", "domestic"))
    _, candidates = Placement(settings()).place("glm", view)
    assert [r.id for r in candidates] == ["d"]


def test_unpooled_replicas_never_serve_a_declared_model() -> None:
    view = cluster(replica("loose", None), replica("d", "domestic"))
    _, candidates = Placement(settings()).place(MODEL, view)
    assert [r.id for r in candidates] == ["d"]


def test_long_prompt_skips_pools_with_short_context_then_400() -> None:
    p = Placement(settings())
    _, candidates = p.place(MODEL, two_pools(), prompt_tokens=100_000)
    assert {r.pool for r in candidates} == {"h200"}
    with pytest.raises(ContextTooLong) as err:
        p.place(MODEL, two_pools(), prompt_tokens=200_000)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
