"""Read the recorded engine fixtures (tests/fixtures/engines, written by
tools/record_engine_fixtures.py from the engines' released wheels)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
VLLM = "vllm-0.33.0"
SGLANG = "sglang-0.5.23"
ENGINES = (VLLM, SGLANG)


@dataclass(frozen=True)
class Scenario:
    engine: str
    name: str
    dp_rank: int
    topic: str
    live: list[list[bytes]]
    replay_from_0: list[list[bytes]]
    replay_from_last: list[list[bytes]]
    raw: dict[str, Any]


@cache
def load(engine: str, name: str) -> dict[str, Any]:
    return dict(json.loads((ROOT / engine / name).read_text()))


def _frames(rows: list[list[str]]) -> list[list[bytes]]:
    return [[bytes.fromhex(f) for f in row] for row in rows]


def scenarios(engine: str) -> list[Scenario]:
    out = []
    for name, sc in load(engine, "events.json")["scenarios"].items():
        out.append(
            Scenario(
                engine,
                name,
                sc["dp_rank"],
                sc["topic"],
                _frames(sc["live"]),
                _frames(sc["replay_from_0"]),
                _frames(sc["replay_from_last"]),
                sc,
            )
        )
    return out


def scenario(engine: str, name: str) -> Scenario:
    return next(s for s in scenarios(engine) if s.name == name)


def all_scenarios() -> list[Scenario]:
    return [s for e in ENGINES for s in scenarios(e)]
