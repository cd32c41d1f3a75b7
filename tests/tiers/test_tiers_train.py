"""`kvgate tiers train` end to end: labelled JSONL in, a JSON model the serving side loads.

The labelled rows are synthetic (short chat = easy, long code/math with big outputs = hard):
this tests the mechanism, not a classifier's quality on real traffic.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.errors import ConfigError
from gateway.tiers.features import FeaturesClassifier
from gateway.tiers.train import parse_label, per_label, read_labelled
from gateway.types import Endpoint

ROOT = Path(__file__).resolve().parents[2]


def row(rng: random.Random, hard: bool) -> dict[str, Any]:
    if hard:
        code = "for i in range(n): x[i] = a*b + c/d\n" * rng.randint(20, 80)
        body = {
            "messages": [{"role": "user", "content": f"```py\n{code}```\nwhy is this slow?"}],
            "max_tokens": rng.choice([1024, 2048]),
        }
    else:
        body = {
            "messages": [
                {"role": "user", "content": "say hi to " + "friend " * rng.randint(1, 20)}
            ],
            "max_tokens": rng.choice([16, 64]),
        }
    return {"request": body, "label": "hard" if hard else "easy"}


def test_train_writes_a_model_the_classifier_serves(tmp_path: Path) -> None:
    rng = random.Random(7)
    labelled = tmp_path / "labelled.jsonl"
    rows = [row(rng, i % 3 == 0) for i in range(300)]
    labelled.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    out = tmp_path / "model.json"
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "tiers", "train", str(labelled), "-o", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "trained on 240 of 300 requests (100 hard)" in done.stdout
    assert "held out, hard: precision" in done.stdout
    model = orjson.loads(out.read_bytes())
    assert model["kind"] == "kvgate-tiers-logistic" and len(model["weights"]) == 8
    clf = FeaturesClassifier(FeaturesClassifier.Config(model_path=str(out)))
    fresh = [row(rng, hard) for hard in (True, False) * 20]
    labels = [clf.classify(Endpoint.CHAT, r["request"]).label for r in fresh]
    assert labels == [r["label"] for r in fresh]


def test_labels_and_errors(tmp_path: Path) -> None:
    assert [parse_label(v, "x") for v in ("hard", "LARGE", 1, True, "easy", 0, "small")] == [
        1,
        1,
        1,
        1,
        0,
        0,
        0,
    ]
    with pytest.raises(ConfigError, match="label 'maybe'"):
        parse_label("maybe", "f:1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1"):
        read_labelled(bad)
    scores = per_label([1, 1, 0, 0], [1, 0, 0, 0])
    assert [(s.label, s.precision, s.recall) for s in scores] == [
        ("easy", 2 / 3, 1.0),
        ("hard", 1.0, 0.5),
    ]
