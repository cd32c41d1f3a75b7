"""Class resolution order and settings validation."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.admission.classes import ClassMap, resolve_class
from gateway.admission.config import AdmissionSettings, PriorityClass
from gateway.errors import BadRequest

SETTINGS = AdmissionSettings(
    classes=(
        PriorityClass(name="interactive", engine_priority=-10),
        PriorityClass(name="default"),
        PriorityClass(name="batch", engine_priority=10),
    ),
    key_classes={"ci-bot": "batch", "console": "interactive"},
)
CLASSES = ClassMap.from_settings(SETTINGS)


@pytest.mark.parametrize(
    ("key", "header", "body", "expected"),
    [
        (None, None, None, "default"),
        ("ci-bot", "interactive", "interactive", "batch"),  # the key's class wins
        ("unknown-key", "interactive", "batch", "interactive"),  # then the header
        (None, None, "batch", "batch"),  # then the body
        (None, " Interactive ", None, "interactive"),  # header is case/space tolerant
        (None, None, 10, "batch"),  # a vLLM-style integer picks the class by engine priority
        (None, "-10", None, "interactive"),
        (None, None, 1, "default"),  # default class's engine priority is its position
        (None, "", "batch", "batch"),  # an empty header counts as absent
    ],
)
def test_resolution_order(key: str | None, header: str | None, body: Any, expected: str) -> None:
    assert resolve_class(CLASSES, api_key=key, header=header, body_priority=body) == expected


@pytest.mark.parametrize(
    ("header", "body", "param"),
    [
        ("platinum", None, "x-priority"),
        (None, "urgent", "priority"),
        (None, 7, "priority"),
        (None, True, "priority"),
        (None, {"x": 1}, "priority"),
    ],
)
def test_unknown_priority_is_a_400_naming_the_classes(
    header: str | None, body: Any, param: str
) -> None:
    with pytest.raises(BadRequest) as info:
        resolve_class(CLASSES, api_key=None, header=header, body_priority=body)
    assert info.value.status == 400
    assert info.value.param == param
    assert "batch" in info.value.message and "interactive" in info.value.message


def test_defaults_are_valid_and_bound_is_derived() -> None:
    s = AdmissionSettings()
    assert not s.enabled
    assert [c.name for c in s.classes] == ["interactive", "default", "batch"]
    assert s.aging_bound_s == s.class_head_start_s * 2 + s.size_head_start_s


@pytest.mark.parametrize(
    "raw",
    [
        {"default_class": "gold"},
        {"classes": [{"name": "a"}, {"name": "a"}], "default_class": "a"},
        {"classes": []},
        {"key_classes": {"k": "gold"}},
        {"max_wait_s": 0},
        {"saturation": {"max_kv_usage": 1.5}},
        {"unknown_knob": 1},
        {"classes": [{"name": "a", "weight": 2}], "default_class": "a"},
    ],
)
def test_invalid_settings_are_rejected(raw: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        AdmissionSettings.model_validate(raw)
