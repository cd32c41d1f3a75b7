from __future__ import annotations

import argparse
import http.client
import importlib.metadata
import logging
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.cli import _reload, build_parser, main
from gateway.testing.process import kvgate_serve
from gateway.testing.servers import gateway, replica_config, sim_engines

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


# -- the entry point's exit codes and one-line messages --------------------------------


def test_check_config_through_the_module_entry_point(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  workers: 0\n")
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0] == f"{bad}: 1 problem(s)"
    assert lines[1].startswith("  server.workers: ") and "(got 0)" in lines[1]


@pytest.mark.parametrize("argv", [[], ["no-such-command"]])
def test_a_missing_or_unknown_command_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvgate")


def test_check_config_of_a_missing_file_is_one_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "absent.yaml"
    assert main(["check-config", str(missing)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"{missing}: 1 problem(s)"
    assert err[1].startswith("  cannot read config file") and len(err) == 2


def test_serve_with_an_unreadable_config_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "-c", str(tmp_path / "absent.yaml")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvgate: cannot read config file")


def test_help_shows_defaults_only_where_they_say_something() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    # A feature's own subparser gets the formatter too, however it was registered.
    sim_help = " ".join(sub.choices["sim"].format_help().split())
    assert "address the engines listen on (default: 127.0.0.1)" in sim_help
    # Help that already names its default is not told it twice.
    assert "number of engines (default 1)" in sim_help and "(default: 1)" not in sim_help
    serve_help = sub.choices["serve"].format_help()
    assert "(default: None)" not in serve_help and "(default: False)" not in serve_help


# -- SIGHUP's reload, in process, against a running gateway -------------------------------


async def test_reload_adds_a_replica_and_keeps_them_on_a_broken_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tmp_path / "gw.yaml"
    async with sim_engines(2, "instant") as engines, gateway(engines[:1]) as gw:
        state = gw.state
        assert set(state.cluster.members) == {"e0"}
        cfg.write_text(yaml.safe_dump({"replicas": replica_config(engines)}))
        await _reload(state, str(cfg))
        assert set(state.cluster.members) == {"e0", "e1"}
        # Both now take requests: the new member is reachable through the gateway.
        seen = set()
        async with httpx.AsyncClient(base_url=gw.url) as client:
            for i in range(12):
                r = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "kvgate-sim",
                        "messages": [{"role": "user", "content": f"conversation {i}"}],
                        "max_tokens": 1,
                    },
                )
                assert r.status_code == 200
                seen.add(r.headers["x-kvgate-replica"])
        assert seen == {"e0", "e1"}

        cfg.write_text("replicas: [\n")
        with caplog.at_level(logging.ERROR, logger="kvgate"):
            await _reload(state, str(cfg))
        assert "not reloaded, keeping the current replicas" in caplog.text
        assert set(state.cluster.members) == {"e0", "e1"}

        cfg.write_text("server:\n  port: 0\n")  # no replicas listed: kept, not emptied
        await _reload(state, str(cfg))
        assert set(state.cluster.members) == {"e0", "e1"}

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvgate"):
            await _reload(state, None)
        assert "no config file" in caplog.text
