from __future__ import annotations

from typing import Any

import pytest
from pools_helpers import settings
from pydantic import ValidationError

from gateway.pools.config import PoolsSettings


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
