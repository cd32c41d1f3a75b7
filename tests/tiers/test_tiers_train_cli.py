"""`kvgate tiers train` in this process: what the operator sees for files it cannot read
or write, bad rows and a one-sided data set; and `train` itself without a held-out share."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from gateway.cli import main
from tests.tiers.test_tiers_train import row


def _write(path: Path, rows: list[object]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def _labelled(tmp_path: Path, n: int = 60) -> Path:
    rng = random.Random(3)
    return _write(tmp_path / "labelled.jsonl", [row(rng, i % 2 == 0) for i in range(n)])


def test_a_file_that_cannot_be_read_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "model.json")
    for missing in (tmp_path / "nope.jsonl", tmp_path):
        assert main(["tiers", "train", str(missing), "-o", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot read") and str(missing) in err
    assert not Path(out).exists()


def test_a_model_that_cannot_be_written_is_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "no-such-dir" / "model.json"
    assert main(["tiers", "train", str(_labelled(tmp_path)), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and str(out) in err
