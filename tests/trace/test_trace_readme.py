"""The README's trace commands, as written: the trace it names is one `kvgate trace generate`
writes, and `kvgate trace stats` reads it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gateway.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_generates_the_trace_its_stats_command_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = (ROOT / "README.md").read_text()
    generate = re.search(r"`kvgate (trace generate [^`]+)`", readme)
    stats = re.search(r"`kvgate (trace stats [^`]+)`", readme)
    assert generate and stats
    written = shlex.split(generate[1])
    read = shlex.split(stats[1])
    assert written[written.index("-o") + 1] == read[2]
    assert not (ROOT / read[2]).exists()  # not shipped: generated, as the README says
    monkeypatch.chdir(tmp_path)
    assert main(written) == 0
    assert main(read) == 0
    out = capsys.readouterr().out
    assert "hit" in out.lower()
