"""`kvgate tiers train` in this process: what the operator sees for files it cannot read
or write, bad rows and a one-sided data set; and `train` itself without a held-out share."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from gateway.cli import main
from gateway.errors import ConfigError
from gateway.tiers.features import FEATURE_NAMES, features
from gateway.tiers.train import read_labelled, train
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


def test_rows_may_be_bodies_or_wrapped_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        orjson.dumps({**chat, "label": "easy"})
        + b"\n\n   \n"
        + orjson.dumps({"request": chat, "label": "hard"})
        + b"\n"
    )
    xs, ys = read_labelled(path)
    assert ys == [0, 1]
    # The label is not part of the request: both rows have the same features.
    assert xs[0] == xs[1] == features(chat)


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (b"{not json", "rows.jsonl:3: not JSON"),
        (b'{"request": [1], "label": 1}', "rows.jsonl:3: 'request' must be an object"),
        (b"[1, 2]", "rows.jsonl:3: expected an object"),
        (b'{"label": "perhaps"}', "rows.jsonl:3: label 'perhaps'"),
    ],
)
def test_a_bad_row_is_named_by_its_line(tmp_path: Path, line: bytes, said: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"label": 0}\n\n' + line + b"\n")
    with pytest.raises(ConfigError, match=said):
        read_labelled(path)


def test_training_needs_both_labels_and_may_hold_nothing_out() -> None:
    easy = [features({"prompt": "x" * n}) for n in range(1, 20)]
    with pytest.raises(ConfigError, match="needs both labels"):
        train(easy, [0] * len(easy))
    hard = [features({"prompt": "```a```" * n, "max_tokens": 4000}) for n in range(1, 20)]
    trained = train(easy + hard, [0] * 19 + [1] * 19, test_share=0.0)
    assert trained.train_rows == 38 and trained.test == ()
    assert trained.model["features"] == list(FEATURE_NAMES)
    assert len(trained.model["mean"]) == len(trained.model["scale"]) == len(FEATURE_NAMES)


def test_the_cli_refuses_a_share_outside_0_1_and_one_sided_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labelled, out = str(_labelled(tmp_path)), str(tmp_path / "m.json")
    for share in ("1.0", "-0.1"):
        assert main(["tiers", "train", labelled, "-o", out, "--test-share", share]) == 2
        assert "--test-share must be in [0, 1)" in capsys.readouterr().err
    easy = _write(tmp_path / "easy.jsonl", [{"prompt": "a", "label": 0}] * 5)
    assert main(["tiers", "train", str(easy), "-o", out]) == 2
    assert capsys.readouterr().err.startswith("error: training needs both labels")
    assert not Path(out).exists()


def test_the_cli_with_nothing_held_out_reports_no_scores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.json"
    assert (
        main(["tiers", "train", str(_labelled(tmp_path)), "-o", str(out), "--test-share", "0"]) == 0
    )
    said = capsys.readouterr().out
    assert said.startswith("trained on 60 of 60 requests (30 hard)") and "held out" not in said
    assert orjson.loads(out.read_bytes())["note"].endswith("on 60 labelled requests")
