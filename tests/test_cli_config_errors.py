"""Broken configuration is reported, never a traceback (issue 19, item 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main


def test_non_utf8_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"server:\n  host: caf\xe9\n")
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "UTF-8" in err and "Traceback" not in err
    assert main(["serve", "-c", str(bad)]) == 2
    assert "UTF-8" in capsys.readouterr().err


def test_invalid_json_in_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = tmp_path / "ok.yaml"
    ok.write_text("server:\n  port: 9000\n")
    monkeypatch.setenv("KVGATE_REPLICAS", "[{bad")
    assert main(["check-config", str(ok)]) == 1
    err = capsys.readouterr().err
    assert "KVGATE_REPLICAS" in err and "JSON" in err
    assert main(["serve", "-c", str(ok)]) == 2
    assert "KVGATE_REPLICAS" in capsys.readouterr().err
