"""The collector settings `kvgate serve` applies, in a process of their own (they are global)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gateway.collector import YOUNG_THRESHOLD

ROOT = Path(__file__).resolve().parents[1]


def test_serve_freezes_the_start_up_heap_and_collects_the_young_less_often() -> None:
    script = (
        "import gc; from gateway.app import build_app; from gateway.collector import "
        "tune_collector; app = build_app(); before = gc.get_threshold()[0]; tune_collector(); "
        "print(before, gc.get_threshold()[0], gc.get_freeze_count())"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    before, after, frozen = map(int, done.stdout.split())
    assert before == 700 and after == YOUNG_THRESHOLD
    assert frozen > 10_000  # the app's objects are out of every collection
