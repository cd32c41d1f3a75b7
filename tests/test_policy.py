"""The policy registry: names resolve once at start-up, and every way to name a policy
wrongly fails with a ConfigError that says what was wrong and what is known."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import ConfigError
from gateway.policy import (
    BUILTIN_POLICIES,
    Policy,
    PolicyConfig,
    PolicyContext,
    build_policy,
    import_string,
    known_policy_names,
    resolve_policy_class,
)
from gateway.types import ReplicaId, ReplicaState


class NotAPolicy:
    Config = PolicyConfig

    def __init__(self, config: PolicyConfig, context: PolicyContext) -> None:
        self.config = config


@pytest.mark.parametrize("target", ["nocolon", ":Class", "module:", ""])
def test_import_string_wants_module_and_attribute(target: str) -> None:
    with pytest.raises(ConfigError, match="module:Class"):
        import_string(target)


def test_import_string_names_the_missing_module_or_attribute() -> None:
    with pytest.raises(ConfigError, match=r"cannot import module 'gateway\.nowhere'"):
        import_string("gateway.nowhere:X")
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        import_string("gateway.policy:Nope")


def test_every_builtin_resolves_and_builds_with_defaults() -> None:
    context = PolicyContext(replicas=(ReplicaState(ReplicaId("a"), "http://127.0.0.1:1"),))
    for name in BUILTIN_POLICIES:
        assert name in known_policy_names()
        policy = build_policy(name, None, context)
        assert isinstance(policy, Policy)
        assert type(policy) is resolve_policy_class(name)


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_policy_class("least-lod")
    assert caught.value.param == "routing.policy"
    for name in BUILTIN_POLICIES:
        assert name in caught.value.message


@pytest.mark.parametrize("name", sorted(BUILTIN_POLICIES))
def test_an_unknown_config_field_is_refused_with_its_section(name: str) -> None:
    raw: dict[str, Any] = {"no_such_knob": 1}
    with pytest.raises(ConfigError) as caught:
        build_policy(name, raw, PolicyContext())
    assert caught.value.param == f"routing.policies.{name}"
    assert "no_such_knob" in caught.value.message


def test_a_class_without_choose_is_refused() -> None:
    with pytest.raises(ConfigError, match="does not implement choose"):
        build_policy(f"{__name__}:NotAPolicy", {}, PolicyContext())


def test_a_module_class_string_builds_a_third_party_policy() -> None:
    policy = build_policy("tests.sample_third_party_policy:Reverse", {}, PolicyContext())
    assert isinstance(policy, Policy)
