from __future__ import annotations

from typing import Any

import pytest
from pools_helpers import settings
from pydantic import ValidationError

from gateway.pools.config import PoolsSettings, eligible


def test_example_settings_validate() -> None:
    s = settings()
    assert s.pool("h200") is not None and s.pool("h200").price_per_replica_hour == 8.0  # type: ignore[union-attr]
    assert s.controller.low_watermark < s.controller.high_watermark


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"models": [{"name": "m", "pools": ["nope"]}]}, "unknown pool 'nope'"),
        ({"models": [{"name": "m", "requires": ["fp2"]}]}, "no configured pool satisfies"),
        ({"models": [{"name": "m", "min_context": 200000}]}, "no configured pool satisfies"),
        (
            {"models": [{"name": "a", "aliases": ["x"]}, {"name": "b", "aliases": ["x"]}]},
            "already belongs to model 'a'",
        ),
        ({"rules": [{"priority_class": "batch", "prefer": ["gone"]}]}, "unknown pool 'gone'"),
        ({"rules": [{"prefer": ["h200"]}]}, "needs priority_class and/or tenant"),
        ({"initial_weights": {"h200": 0, "domestic": 0}}, "must not all be zero"),
        ({"controller": {"low_watermark": 0.9, "high_watermark": 0.8}}, "below high_watermark"),
        ({"controller": {"max_step": 0}}, "greater than 0"),
        ({"surprise": 1}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_settings_are_rejected_with_a_reason(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        settings(**overrides)


def test_duplicate_pool_names_rejected() -> None:
    pool = {"name": "p", "price_per_card_hour": 1}
    with pytest.raises(ValidationError, match="unique"):
        PoolsSettings.model_validate({"pools": [pool, pool]})


def test_settings_are_frozen() -> None:
    s = settings()
    with pytest.raises(ValidationError):
        s.strict_models = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"new_sessions_pool": "moon"}, "new_sessions_pool: unknown pool 'moon'"),
        ({"initial_weights": {"mars": 1.0}}, "initial_weights: unknown pool 'mars'"),
        (
            {"initial_weights": {"h200": -1.0, "domestic": 2.0}},
            r"initial_weights\.h200: must be >= 0",
        ),
        (
            {"models": [{"name": "a"}, {"name": "b", "aliases": ["a"]}]},
            "name 'a' already belongs to model 'a'",
        ),
    ],
)
def test_cross_references_name_the_field_and_the_value(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        settings(**overrides)


def test_a_model_may_repeat_its_own_name_as_an_alias() -> None:
    s = settings(models=[{"name": "a", "aliases": ["a", "b"]}])
    assert [m.name for m in s.models] == ["a"]


@pytest.mark.parametrize(
    ("model", "allowed"),
    [
        ({"name": "m"}, {"h200", "domestic"}),
        ({"name": "m", "requires": ["fp4"]}, {"h200"}),
        ({"name": "m", "min_context": 65536}, {"h200", "domestic"}),
        ({"name": "m", "min_context": 65537}, {"h200"}),
        ({"name": "m", "pools": ["domestic"], "requires": ["fp8"]}, {"domestic"}),
    ],
)
def test_eligible_pools_meet_every_requirement(model: dict[str, Any], allowed: set[str]) -> None:
    s = settings(models=[model])
    assert {p.name for p in s.pools if eligible(p, s.models[0])} == allowed
    assert s.pool("nowhere") is None


def test_a_pool_of_unknown_context_never_meets_a_minimum() -> None:
    pool = {"name": "p", "price_per_card_hour": 1}
    s = PoolsSettings.model_validate({"pools": [pool], "models": [{"name": "m"}]})
    assert eligible(s.pools[0], s.models[0])
    with pytest.raises(ValidationError, match="no configured pool satisfies"):
        PoolsSettings.model_validate({"pools": [pool], "models": [{"name": "m", "min_context": 1}]})
