"""The documented names match the code: metric table, example config, documented YAML."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from gateway.tiers.config import Tier, TieredModel, TiersSettings
from gateway.tiers.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]


def test_metric_reference_table_matches_the_collector() -> None:
    text = (ROOT / "docs" / "tiers.md").read_text()
    documented = set(re.findall(r"^\| `(kvgate_tier_\w+)` \|", text, re.MULTILINE))
    assert documented == set(METRICS)


def test_commented_example_config_is_valid_and_complete() -> None:
    text = (ROOT / "gateway.example.yaml").read_text()
    block = text[text.index("\ntiers: null\n") : text.index("\npools: null\n")]
    lines = [line[1:] for line in block.splitlines() if line.startswith("#  ")]
    raw = yaml.safe_load("\n".join(lines))
    settings = TiersSettings.model_validate(raw["tiers"])
    assert [t.name for t in settings.models[0].tiers] == ["small", "large"]
    shown = "\n".join(lines)
    for name in (*TiersSettings.model_fields, *TieredModel.model_fields, *Tier.model_fields):
        assert re.search(rf"\b{name}:", shown), f"{name} missing from gateway.example.yaml"


def test_the_configuration_in_the_docs_is_valid() -> None:
    text = (ROOT / "docs" / "tiers.md").read_text()
    snippet = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    settings = TiersSettings.model_validate(yaml.safe_load(snippet)["tiers"])
    assert len(settings.models[0].rules) == 7
