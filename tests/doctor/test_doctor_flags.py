"""Doctor findings for the engine flags kvgate needs, on SGLang's declared defaults as
recorded from its 0.5.23 wheel (tests/fixtures/engines)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gateway.doctor.engine import check_engine
from gateway.doctor.findings import Hints
from gateway.doctor.probe import EngineSnapshot, parse_engine
from tests.kvevents.engine_fixtures import SGLANG, load


def sglang_snapshot(**args: Any) -> EngineSnapshot:
    fx = load(SGLANG, "metrics.json")
    series = {s["name"]: s for s in fx["series"]}
    labels = ",".join(f'{k}="0"' for k in series["sglang:num_queue_reqs"]["labels"])
    text = "".join(
        f"# TYPE {name} gauge\n{name}{{{labels}}} {value}\n"
        for name, value in (
            ("sglang:num_queue_reqs", 0),
            ("sglang:num_running_reqs", 1),
            ("sglang:token_usage", 0.1),
        )
    )
    snap = parse_engine("http://s", text, 0.0)
    # Declared defaults, with page_size as SGLang resolves it on CUDA (1).
    return dataclasses.replace(
        snap, server_args={**fx["server_args_defaults"], "page_size": 1, **args}
    )


def codes(snap: EngineSnapshot, hints: Hints) -> dict[str, str]:
    return {f.code: f.suggestion for f in check_engine("http://s", [snap], hints)}


def test_sglang_defaults_name_each_flag() -> None:
    found = codes(sglang_snapshot(), Hints(priority_scheduling=True, kv_block_size=16))
    assert "--enable-metrics" in found["metrics_off"]
    assert "--enable-cache-report" in found["cached_tokens_off"]
    assert "--enable-prompt-tokens-details" in found["cached_tokens_off"]
    assert "--page-size 16" in found["event_block_size"]
    assert "--schedule-low-priority-values-first" in found["priority_higher_first"]


def test_a_well_set_engine_has_none_of_them() -> None:
    snap = sglang_snapshot(
        enable_metrics=True,
        enable_cache_report=True,
        page_size=16,
        schedule_low_priority_values_first=True,
    )
    found = codes(snap, Hints(priority_scheduling=True, kv_block_size=16))
    assert not {
        "metrics_off",
        "cached_tokens_off",
        "event_block_size",
        "priority_higher_first",
        "priority_direction_unknown",
    } & set(found)


def test_an_unknown_direction_is_said() -> None:
    args = dict(load(SGLANG, "metrics.json")["server_args_defaults"])
    snap = dataclasses.replace(
        sglang_snapshot(),
        server_args={k: v for k, v in args.items() if k != "schedule_low_priority_values_first"},
    )
    assert "priority_direction_unknown" in codes(snap, Hints(priority_scheduling=True))


def test_metrics_404_says_enable_metrics_not_unreachable() -> None:
    snap = EngineSnapshot("http://s", 0.0, error="/metrics answered 404")
    (finding,) = check_engine("http://s", [snap], Hints())
    assert finding.code == "metrics_off" and "--enable-metrics" in finding.suggestion
