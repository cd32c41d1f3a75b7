"""The benchmarks are not run by the suite (they take minutes and want a quiet machine),
but each must at least parse and answer --help, so a typo is caught before a long run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LOADTESTS = Path(__file__).resolve().parents[1] / "loadtests"
# locustfile imports locust (gevent monkey-patching): compiled only, never imported.
SCRIPTS = sorted(p for p in LOADTESTS.glob("bench_*.py"))


def test_every_loadtest_compiles() -> None:
    for path in sorted(LOADTESTS.glob("*.py")):
        compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_answers_help(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
