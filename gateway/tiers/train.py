"""`kvgate tiers train`: fit the `features` classifier on the operator's labelled requests.

Input: JSONL, one labelled request a line: the request body (or `{"request": body}`) with
`"label"`: 1/true/"hard"/"large" for requests the small tier should not take, 0/false/
"easy"/"small" for those it should. Output: the plain JSON model the `features` classifier
loads (`model_path`). scikit-learn is imported here only: serving never needs it.

A share of the rows (`--test-share`) is held out and precision and recall per label are
reported on it; they measure the classifier on *this* data only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.errors import ConfigError
from gateway.tiers.features import FEATURE_NAMES, MODEL_KIND, features

HARD_LABELS = frozenset({"1", "true", "hard", "large"})
EASY_LABELS = frozenset({"0", "false", "easy", "small"})


@dataclass(frozen=True, slots=True)
class Scores:
    label: str
    precision: float
    recall: float
    support: int


@dataclass(frozen=True, slots=True)
class Trained:
    model: dict[str, Any]
    train_rows: int
    test: tuple[Scores, ...]


def parse_label(value: Any, where: str) -> int:
    text = str(value).strip().lower()
    if text in HARD_LABELS:
        return 1
    if text in EASY_LABELS:
        return 0
    raise ConfigError(f"{where}: label {value!r} is not one of hard/easy, large/small, 1/0")


def read_labelled(path: Path) -> tuple[list[tuple[float, ...]], list[int]]:
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    xs: list[tuple[float, ...]] = []
    ys: list[int] = []
    with fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not JSON ({exc})") from exc
            if not isinstance(row, Mapping) or "label" not in row:
                raise ConfigError(f"{where}: expected an object with a 'label'")
            body = row.get("request", row)
            if not isinstance(body, Mapping):
                raise ConfigError(f"{where}: 'request' must be an object")
            ys.append(parse_label(row["label"], where))
            xs.append(features(body))
    return xs, ys


def per_label(truth: Sequence[int], predicted: Iterable[int]) -> tuple[Scores, ...]:
    pairs = list(zip(truth, predicted, strict=True))
    out = []
    for value, name in ((0, "easy"), (1, "hard")):
        tp = sum(1 for t, p in pairs if t == value and p == value)
        said = sum(1 for _, p in pairs if p == value)
        real = sum(1 for t, _ in pairs if t == value)
        out.append(Scores(name, tp / said if said else 0.0, tp / real if real else 0.0, real))
    return tuple(out)


def train(
    xs: Sequence[Sequence[float]], ys: Sequence[int], test_share: float = 0.2, seed: int = 0
) -> Trained:
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    if len(set(ys)) < 2:
        raise ConfigError("training needs both labels (some hard and some easy requests)")
    if test_share > 0:
        x_train, x_test, y_train, y_test = train_test_split(
            list(xs), list(ys), test_size=test_share, random_state=seed, stratify=list(ys)
        )
    else:
        x_train, x_test, y_train, y_test = list(xs), [], list(ys), []
    scaler = StandardScaler().fit(x_train)
    # A constant feature has scale 0; sklearn leaves it at 1 after fitting, as we need.
    fitted = LogisticRegression(max_iter=1000, class_weight="balanced").fit(
        scaler.transform(x_train), y_train
    )
    model = {
        "kind": MODEL_KIND,
        "features": list(FEATURE_NAMES),
        "weights": [float(w) for w in fitted.coef_[0]],
        "intercept": float(fitted.intercept_[0]),
        "mean": [float(m) for m in scaler.mean_],
        "scale": [float(s) for s in scaler.scale_],
        "note": f"trained by kvgate tiers train on {len(x_train)} labelled requests",
    }
    scores: tuple[Scores, ...] = ()
    if x_test:
        predicted = fitted.predict(scaler.transform(x_test))
        scores = per_label(y_test, (int(p) for p in predicted))
    return Trained(model, len(x_train), scores)
