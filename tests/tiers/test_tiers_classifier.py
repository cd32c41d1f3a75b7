"""The classifier registry and the built-in `features` classifier."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.errors import ConfigError
from gateway.tiers.classify import Classification, build_classifier, known_classifier_names
from gateway.tiers.features import DEFAULT_MODEL, FEATURE_NAMES, FeaturesClassifier, features
from gateway.types import Endpoint


class Always:
    """A third-party classifier, loaded by its import string."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def classify(self, endpoint: Endpoint, body: Any) -> Classification:
        return Classification(1.0, "hard")


def test_registry_by_name_and_import_string() -> None:
    assert "features" in known_classifier_names()
    built = build_classifier("features", {"threshold": 0.3})
    assert isinstance(built, FeaturesClassifier)
    third = build_classifier(f"{__name__}:Always", None)
    assert third.classify(Endpoint.CHAT, {}).label == "hard"
    with pytest.raises(ConfigError, match="known classifiers: features"):
        build_classifier("nope", None)
    with pytest.raises(ConfigError, match="invalid config"):
        build_classifier("features", {"bogus": 1})


def test_features_read_the_request() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "```py\nx = 1 + 2\n```"}]},
            {"role": "user", "content": "日本語"},
        ],
        "tools": [{"type": "function"}],
        "response_format": {"type": "json_object"},
        "max_tokens": 100,
    }
    x = dict(zip(FEATURE_NAMES, features(body), strict=True))
    assert x["turns"] == 3
    assert x["code_blocks"] == 1
    assert x["math_share"] > 0.1
    assert 0 < x["non_ascii_share"] <= 1
    assert x["tools"] == x["json_output"] == 1.0
    assert x["log_max_tokens"] > 4
    assert features({"prompt": ""})[0] == 0.0


def test_default_heuristic_orders_easy_below_hard() -> None:
    clf = FeaturesClassifier(FeaturesClassifier.Config())
    easy = clf.classify(Endpoint.CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    hard_body = {
        "messages": [{"role": "user", "content": "```c\n" + "int x = a*b + c;\n" * 400 + "```"}],
        "max_tokens": 2048,
    }
    hard = clf.classify(Endpoint.CHAT, hard_body)
    assert easy.label == "easy" and hard.label == "hard"
    assert easy.score < 0.1
    assert hard.score > 0.9


def test_a_model_file_is_loaded_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_bytes(orjson.dumps({**DEFAULT_MODEL, "intercept": 50.0}))
    clf = FeaturesClassifier(FeaturesClassifier.Config(model_path=str(path)))
    assert clf.classify(Endpoint.CHAT, {"prompt": "x"}).score > 0.99
    path.write_bytes(orjson.dumps({**DEFAULT_MODEL, "features": ["a"]}))
    with pytest.raises(ConfigError, match="features"):
        FeaturesClassifier(FeaturesClassifier.Config(model_path=str(path)))
    with pytest.raises(ConfigError, match="cannot read"):
        FeaturesClassifier(FeaturesClassifier.Config(model_path=str(tmp_path / "none.json")))


def test_decision_cost_is_microseconds() -> None:
    clf = FeaturesClassifier(FeaturesClassifier.Config())
    body = {"messages": [{"role": "user", "content": "explain this " * 80}], "max_tokens": 256}
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        clf.classify(Endpoint.CHAT, body)
    per_call_us = (time.perf_counter() - start) / n * 1e6
    # generous bound for a shared 2-core machine; the benchmark reports the real figure
    assert per_call_us < 500, per_call_us
