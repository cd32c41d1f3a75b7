"""The documented names match the code: metric table, example config."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from gateway.pools.config import ControllerSettings, PoolsSettings
from gateway.pools.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]


def test_metric_reference_table_matches_the_collector() -> None:
    text = (ROOT / "docs" / "pools.md").read_text()
    documented = set(re.findall(r"^\| (kvgate_pool_\w+) \|", text, re.MULTILINE))
    assert documented == set(METRICS)


def test_commented_example_config_is_valid_and_complete() -> None:
    text = (ROOT / "gateway.example.yaml").read_text()
    block = text[text.index("\npools: null\n") :]
    lines = [line[1:] for line in block.splitlines() if line.startswith("#  ")]
    raw = yaml.safe_load("\n".join(lines))
    settings = PoolsSettings.model_validate(raw)
    assert [p.name for p in settings.pools] == ["h200", "domestic"]
    shown = "\n".join(lines)
    for name in (*PoolsSettings.model_fields, *ControllerSettings.model_fields):
        assert re.search(rf"\b{name}:", shown), f"{name} missing from gateway.example.yaml"
