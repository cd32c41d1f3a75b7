from __future__ import annotations

import http.client
import importlib.metadata
import time
from pathlib import Path

import httpx
import pytest

from gateway.cli import build_parser, main
from gateway.testing.process import kvgate_serve

ROOT = Path(__file__).resolve().parents[1]


def test_check_config_ok_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "gateway.example.yaml")]) == 0
    assert "OK" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  port: -1\nretries:\n  max_attempts: 0\n")
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "server.port:" in err and "retries.max_attempts:" in err and "2 problem(s)" in err


def test_parser_lists_feature_subcommands() -> None:
    parser = build_parser()
    help_text = parser.format_help()
    assert "serve" in help_text and "check-config" in help_text


def test_version_is_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvgate {importlib.metadata.version('kvgate')}"


def test_serve_refuses_bad_config_and_multi_worker_sim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nope: 1\n")
    assert main(["serve", "-c", str(bad)]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["serve", "--workers", "2"]) == 2


def test_kvgate_serve_without_arguments_answers_openai_requests() -> None:
    embedded = {"KVGATE_SIM__PROFILE": "instant", "KVGATE_SIM__REPLICAS": "2"}
    with kvgate_serve(env=embedded, cwd=ROOT) as (_, port):
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={
                "model": "kvgate-sim",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert r.status_code == 200 and r.headers["x-kvgate-replica"].startswith("sim-")
        # An idle client connection outlives the 5 s after which httpx and the openai SDK
        # drop theirs (and uvicorn, by default, its own): the client closes first.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/health")
            first = conn.getresponse()
            first.read()
            sock = conn.sock
            time.sleep(6.0)
            conn.request("GET", "/health")  # RemoteDisconnected if the gateway had closed it
            assert conn.getresponse().status == 200 and conn.sock is sock
        finally:
            conn.close()
