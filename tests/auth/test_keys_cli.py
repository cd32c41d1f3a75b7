"""`kvgate keys` against a real redis-server: the store from the gateway's config, secrets
from standard input or a file, and one line with the cause when Redis cannot be reached."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.auth.principal import hash_key
from gateway.cli import main as kvgate
from gateway.store.keys import StoreKeys
from gateway.testing.process import free_port
from tests.store.conftest import RedisServer


def config(tmp_path: Path, url: str, prefix: str = "kvgate") -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(f"store:\n  backend: redis\n  url: {url}\n  key_prefix: {prefix}\n")
    return str(path)


def test_keys_use_the_configs_store_and_read_secrets_from_stdin_or_a_file(
    tmp_path: Path,
    redis_server: RedisServer,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = config(tmp_path, redis_server.url, key_prefix)
    monkeypatch.setattr(sys, "stdin", io.StringIO("sk-bob-secret\n"))
    assert kvgate(["keys", "add", "-c", cfg, "--name", "bob", "--key-file", "-"]) == 0
    assert capsys.readouterr().out.strip() == "sk-bob-secret"  # printed once, as with a new key
    # Where the config said: that prefix's hash, on that server.
    stored = redis_server.client().hgetall(StoreKeys(key_prefix).api_keys())
    assert list(stored) == [hash_key("sk-bob-secret").encode()]
    assert kvgate(["keys", "add", "-c", cfg, "--name", "carol", "--tenant", "t1"]) == 0
    generated = capsys.readouterr().out.strip()
    assert generated.startswith("sk-kvgate-")
    assert kvgate(["keys", "list", "-c", cfg]) == 0
    listed = capsys.readouterr().out
    assert "bob" in listed and "carol" in listed and "sk-bob-secret" not in listed
    secret = tmp_path / "bob.key"
    secret.write_text("sk-bob-secret\n")
    assert kvgate(["keys", "revoke", "-c", cfg, "--key-file", str(secret)]) == 0
    assert kvgate(["keys", "revoke", "-c", cfg, "carol"]) == 0
    assert redis_server.client().hgetall(StoreKeys(key_prefix).api_keys()) == {}
    assert kvgate(["keys", "revoke", "-c", cfg, "carol"]) == 1
    assert "no shared key named or hashed 'carol'" in capsys.readouterr().err


def test_hash_reads_the_key_from_stdin_and_never_takes_it_as_an_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("sk-abc\n"))
    assert kvgate(["keys", "hash"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("sk-abc")
    for argv in (["keys", "hash", "sk-abc"], ["keys", "add", "--name", "x", "--key", "sk-abc"]):
        with pytest.raises(SystemExit) as refused:
            kvgate(argv)
        assert refused.value.code == 2
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert kvgate(["keys", "hash"]) == 1
    assert capsys.readouterr().err.strip().endswith("expected one key on one line")


@pytest.mark.parametrize("command", [["list"], ["add", "--name", "x"], ["revoke", "x"]])
def test_unreachable_redis_is_one_line_with_the_cause(tmp_path: Path, command: list[str]) -> None:
    port = free_port()  # nothing listens there
    cfg = config(tmp_path, f"redis://:hunter2@127.0.0.1:{port}/0")
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", command[0], "-c", cfg, *command[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"kvgate keys: Redis at redis://:***@127.0.0.1:{port}/0")
    assert f"store.url in {cfg}" in lines[0] and "refused" in lines[0].lower()
    assert "hunter2" not in done.stderr


def test_a_bad_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("store:\n  urll: redis://127.0.0.1:1/0\n")
    assert kvgate(["keys", "list", "-c", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "store.urll" in err[0]
