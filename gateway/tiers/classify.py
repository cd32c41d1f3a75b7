"""`Classifier`: how hard a request looks, as a score in 0..1 (1: hard) and a label.

A classifier is pure and synchronous: the request's body in, a `Classification` out, in
microseconds, no I/O (it runs on the event loop for every tiered request). Like routing
policies (gateway.policy) they are registered by name: `BUILTIN_CLASSIFIERS`, then the
entry-points group `kvgate.classifiers`, then a literal `module:Class`. Each class has a
frozen pydantic `Config` and is constructed as `cls(config)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.errors import ConfigError
from gateway.policy import find_registered, registered_names
from gateway.types import Endpoint

ENTRY_POINT_GROUP = "kvgate.classifiers"
BUILTIN_CLASSIFIERS: dict[str, str] = {
    "features": "gateway.tiers.features:FeaturesClassifier",
}


@dataclass(frozen=True, slots=True)
class Classification:
    score: float  # 0..1, higher is harder
    label: str


class ClassifierConfig(BaseModel):
    """Base of every classifier's own config: frozen, unknown keys are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@runtime_checkable
class Classifier(Protocol):
    def classify(self, endpoint: Endpoint, body: Mapping[str, Any]) -> Classification:
        """Score one validated request body. Pure, synchronous, no I/O."""
        ...


class ClassifierFactory(Protocol):
    Config: ClassVar[type[ClassifierConfig]]

    def __call__(self, config: Any) -> Classifier: ...


def known_classifier_names() -> list[str]:
    return registered_names(BUILTIN_CLASSIFIERS, ENTRY_POINT_GROUP)


def resolve_classifier(name: str) -> ClassifierFactory:
    found: ClassifierFactory | None = find_registered(name, BUILTIN_CLASSIFIERS, ENTRY_POINT_GROUP)
    if found is not None:
        return found
    raise ConfigError(
        f"unknown classifier {name!r}; known classifiers: {', '.join(known_classifier_names())}"
        " (or give a 'module:Class' import string)",
        param="tiers.models.classifier.name",
    )


def build_classifier(name: str, raw: Mapping[str, Any] | None) -> Classifier:
    """Resolve `name`, validate its config and construct it (once, at start-up)."""
    cls = resolve_classifier(name)
    config_cls: type[ClassifierConfig] = getattr(cls, "Config", ClassifierConfig)
    try:
        config = config_cls.model_validate(dict(raw or {}))
    except ValidationError as exc:
        raise ConfigError(
            f"invalid config for classifier {name!r}: {exc}",
            param="tiers.models.classifier.config",
        ) from exc
    classifier = cls(config)
    if not isinstance(classifier, Classifier):
        raise ConfigError(f"{name!r} does not implement classify(endpoint, body)")
    return classifier
