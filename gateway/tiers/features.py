"""The built-in `features` classifier: cheap request features into a logistic model.

Features (all from the body, one pass over its text, no tokenizer):

| name | what |
|---|---|
| `log_prompt_tokens` | ln(1 + estimated prompt tokens), 4 characters a token |
| `turns` | messages in the conversation |
| `code_blocks` | fenced code blocks (pairs of ```) |
| `math_share` | share of characters that are digits or `=+-*/^\\<>` |
| `non_ascii_share` | share of bytes beyond ASCII (non-Latin scripts) |
| `tools` | 1 when tools or functions are offered |
| `json_output` | 1 when `response_format` asks for JSON |
| `log_max_tokens` | ln(1 + requested output tokens), 0 when not asked |

The score is the logistic of `intercept + sum(w_i * (x_i - mean_i) / scale_i)`. The model is
a plain JSON file (`kvgate tiers train` writes one); `DEFAULT_MODEL` is a hand-set
heuristic (longer, code-heavy, tool-using, long-output requests score harder), not a
trained model, and no quality is claimed for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from pydantic import Field

from gateway.errors import ConfigError
from gateway.hashing import CHARS_PER_TOKEN
from gateway.tiers.classify import Classification, ClassifierConfig
from gateway.types import Endpoint

MODEL_KIND = "kvgate-tiers-logistic"
FEATURE_NAMES: tuple[str, ...] = (
    "log_prompt_tokens",
    "turns",
    "code_blocks",
    "math_share",
    "non_ascii_share",
    "tools",
    "json_output",
    "log_max_tokens",
)
DEFAULT_MODEL: dict[str, Any] = {
    "kind": MODEL_KIND,
    "features": list(FEATURE_NAMES),
    "weights": [0.6, 0.05, 0.8, 6.0, 1.0, 1.0, 0.5, 0.3],
    "intercept": -6.0,
    "mean": [0.0] * len(FEATURE_NAMES),
    "scale": [1.0] * len(FEATURE_NAMES),
    "note": "hand-set heuristic, not trained; no quality claim",
}
_MATH = "0123456789=+-*/^\\<>"
_MAX_EXP = 60.0  # math.exp overflows past ~709; the logistic is flat long before


def _content_text(content: Any, out: list[str]) -> None:
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    out.append(text)


def request_text(body: Mapping[str, Any]) -> tuple[str, int]:
    """The prompt's text (every message, `prompt`, `input`, `instructions`) and its turns."""
    out: list[str] = []
    turns = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        turns = len(messages)
        for message in messages:
            if isinstance(message, Mapping):
                _content_text(message.get("content"), out)
    for field in ("system", "instructions", "prompt", "input", "query"):
        value = body.get(field)
        if isinstance(value, str):
            out.append(value)
            turns = max(turns, 1)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    out.append(item)
                elif isinstance(item, Mapping):
                    _content_text(item.get("content", item.get("text")), out)
            turns = max(turns, len(value))
    return "\n".join(out), turns


def wants_json(body: Mapping[str, Any]) -> bool:
    fmt = body.get("response_format")
    return isinstance(fmt, Mapping) and fmt.get("type") in ("json_object", "json_schema")


def has_tools(body: Mapping[str, Any]) -> bool:
    return bool(body.get("tools") or body.get("functions"))


def requested_output(body: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def features(body: Mapping[str, Any]) -> tuple[float, ...]:
    """The feature vector, in `FEATURE_NAMES` order. Pure; linear in the prompt's size."""
    text, turns = request_text(body)
    chars = len(text)
    if chars:
        math_chars = sum(text.count(c) for c in _MATH)
        non_ascii = len(text.encode("utf-8", "surrogatepass")) - chars
        math_share = math_chars / chars
        non_ascii_share = min(1.0, non_ascii / chars)
    else:
        math_share = non_ascii_share = 0.0
    max_tokens = requested_output(body)
    return (
        math.log1p(chars / CHARS_PER_TOKEN),
        float(turns),
        float(text.count("```") // 2),
        math_share,
        non_ascii_share,
        1.0 if has_tools(body) else 0.0,
        1.0 if wants_json(body) else 0.0,
        math.log1p(max_tokens) if max_tokens else 0.0,
    )


class LogisticModel:
    """A plain-JSON logistic model over `FEATURE_NAMES` (the file `kvgate tiers train`
    writes, or `DEFAULT_MODEL`)."""

    __slots__ = ("coef", "intercept", "note")

    def __init__(self, data: Mapping[str, Any]) -> None:
        if data.get("kind") != MODEL_KIND:
            raise ConfigError(f"not a {MODEL_KIND} model (kind {data.get('kind')!r})")
        names = tuple(data.get("features", ()))
        if names != FEATURE_NAMES:
            raise ConfigError(f"model features {names} are not {FEATURE_NAMES}")
        weights = _floats(data, "weights")
        mean = _floats(data, "mean")
        scale = _floats(data, "scale")
        if any(s == 0.0 for s in scale):
            raise ConfigError("model scale must not contain 0")
        # Standardisation folded into the weights once: w/s, and intercept - sum(w*m/s).
        self.coef = tuple(w / s for w, s in zip(weights, scale, strict=True))
        self.intercept = float(data.get("intercept", 0.0)) - sum(
            c * m for c, m in zip(self.coef, mean, strict=True)
        )
        self.note = str(data.get("note", ""))

    def score(self, x: Sequence[float]) -> float:
        z = self.intercept + sum(c * v for c, v in zip(self.coef, x, strict=True))
        z = max(-_MAX_EXP, min(_MAX_EXP, z))
        return 1.0 / (1.0 + math.exp(-z))


def _floats(data: Mapping[str, Any], key: str) -> list[float]:
    values = data.get(key)
    if not isinstance(values, list) or len(values) != len(FEATURE_NAMES):
        raise ConfigError(f"model {key!r} must be a list of {len(FEATURE_NAMES)} numbers")
    return [float(v) for v in values]


def load_model(path: str | Path | None) -> LogisticModel:
    if path is None:
        return LogisticModel(DEFAULT_MODEL)
    try:
        data = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read classifier model {path}: {exc}") from exc
    return LogisticModel(data)


class FeaturesClassifier:
    """Request features -> logistic score. Cost: one pass over the prompt's text."""

    class Config(ClassifierConfig):
        model_path: str | None = Field(
            None, description="JSON model from `kvgate tiers train` (None: the heuristic)"
        )
        threshold: float = Field(0.5, ge=0.0, le=1.0, description="label 'hard' at or above")

    def __init__(self, config: Config) -> None:
        self._model = load_model(config.model_path)
        self._threshold = config.threshold

    def classify(self, endpoint: Endpoint, body: Mapping[str, Any]) -> Classification:
        score = self._model.score(features(body))
        return Classification(score, "hard" if score >= self._threshold else "easy")
