"""`time_scale` means one thing everywhere: simulated time runs that many times faster than
real time. The example config says so, and the demos run their engines faster, not slower."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.settings import load_settings
from gateway.sim.clock import RealClock

ROOT = Path(__file__).resolve().parents[2]


def test_a_time_scale_of_5_makes_a_simulated_second_last_a_fifth() -> None:
    clock = RealClock(time_scale=5.0)
    assert clock.to_real(1.0) == pytest.approx(0.2)


def test_the_example_config_says_faster_and_its_value_loads_as_the_sim_setting() -> None:
    text = (ROOT / "gateway.example.yaml").read_text()
    line = next(line for line in text.splitlines() if line.strip().startswith("time_scale:"))
    assert "times faster than real" in line and "1 s step takes 0.2 s" in text
    example = load_settings(ROOT / "gateway.example.yaml")
    assert example.sim.time_scale == float(line.split(":")[1].split("#")[0])


@pytest.mark.parametrize(
    "path", ["deploy/compose/docker-compose.yml", "deploy/k8s/overlays/demo/engines.yaml"]
)
def test_the_demo_engines_run_at_least_real_time(path: str) -> None:
    scales = re.findall(r'"--time-scale",\s*"([0-9.]+)"', (ROOT / path).read_text())
    assert scales and all(float(s) >= 1 for s in scales), scales
