"""The fast chaos scenarios (loadtests/chaos.py) on real processes, a few seconds each."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

CHAOS = Path(__file__).resolve().parents[1] / "loadtests" / "chaos.py"


def _load() -> ModuleType:
    if "kvgate_chaos" in sys.modules:
        return sys.modules["kvgate_chaos"]
    spec = importlib.util.spec_from_file_location("kvgate_chaos", CHAOS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvgate_chaos"] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


chaos = _load()


def test_chaos_answers_help_and_lists_every_scenario() -> None:
    for flag, expect in (("--help", "usage:"), ("--list", "sigterm")):
        done = subprocess.run(
            [sys.executable, str(CHAOS), flag],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert expect in done.stdout
    assert set(chaos.SCENARIOS) >= {
        "kill",
        "stall",
        "poison",
        "core_dead",
        "error30",
        "unhealthy70",
        "disconnects",
        "overload",
        "unsolicited",
        "slowloris",
        "oversized",
        "redis",
        "fuzz",
        "sigterm",
    }


def test_table_prints_one_row_per_scenario_with_the_failed_targets() -> None:
    ok = chaos.Row("a", requests=3, checks={"no_gw5xx": True})
    bad = chaos.Row(
        "b", requests=1, gw5xx=1, checks={"no_gw5xx": False, "inflight_0": True}, notes=["why"]
    )
    out = chaos.table([ok, bad])
    lines = out.splitlines()
    assert lines[2].startswith("a ") and lines[2].endswith("PASS")
    assert lines[3].endswith("FAIL no_gw5xx")
    assert "[b] why" in out


def _assert_targets(row: object, *names: str) -> None:
    checks = row.checks  # type: ignore[attr-defined]
    assert all(checks[n] for n in names), chaos.table([row])


async def test_kill_9_of_one_of_two_engines_fails_no_request_that_had_not_started() -> None:
    [row] = await chaos.scenario_kill(chaos.Options(duration=2.5, workers=8))
    _assert_targets(row, "no_unstarted_fail", "no_gw5xx", "ejected", "inflight_0", "no_traceback")
    assert row.requests > 20


async def test_unsolicited_bytes_on_idle_connections_never_reach_another_client() -> None:
    [row] = await chaos.scenario_unsolicited(chaos.Options(duration=1.5, workers=8))
    _assert_targets(row, "own_answers", "no_unstarted_fail", "no_gw5xx", "inflight_0")
    assert row.requests > 20


async def test_a_replica_failing_one_request_kind_is_not_ejected() -> None:
    [row] = await chaos.scenario_poison(chaos.Options(duration=1.5, workers=8))
    _assert_targets(row, "no_unstarted_fail", "no_gw5xx", "no_healthy_ejected", "inflight_0")
    assert row.relayed5xx > 0  # the poisoned completions were relayed, not hidden


async def test_an_engine_whose_core_died_is_taken_out_with_default_health_settings() -> None:
    """/health 503 and every request 500 while /metrics still answers (issue 44)."""
    [row] = await chaos.scenario_core_dead(chaos.Options(duration=3.0, workers=8))
    _assert_targets(row, "ejected", "out_after", "no_gw5xx", "inflight_0", "no_traceback")


async def test_an_engine_answering_500_to_30_percent_is_ejected_with_default_settings() -> None:
    [row] = await chaos.scenario_error30(chaos.Options(duration=3.0, workers=8))
    _assert_targets(row, "ejected", "e1_kept", "no_gw5xx", "inflight_0", "no_traceback")


async def test_fuzzed_bodies_and_headers_get_no_5xx_from_the_gateway() -> None:
    [row] = await chaos.scenario_fuzz(chaos.Options(examples=60))
    _assert_targets(row, "no_gw5xx", "alive", "inflight_0", "no_traceback")
