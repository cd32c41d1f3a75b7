"""`kvgate sim` run for real (gateway.sim.cli): the process serves until SIGTERM and exits 0;
start-up failures (a taken port, engine arguments out of range, a profile the engine
cannot hold) print one `kvgate sim:` line and exit 1; argparse refuses unknown choices."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.sim import cli
from gateway.sim.tokenizer import FileTokenizer

ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvgate")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_the_module_serves_until_sigterm_and_exits_cleanly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.sim.cli", "sim", "--port", "0", "--profile", "tiny"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("engine 0 (both, tiny, vllm) at http://127.0.0.1:"), line
        url = line.rsplit(" ", 1)[1].strip()
        reply = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_a_taken_port_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.run(parse(["sim", "--port", str(port), "--profile", "tiny"]))
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("kvgate sim: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--num-gpu-blocks", "0"], "--num-gpu-blocks is out of range"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization is out of range"),
        (["--replicas", "0"], "replicas must be at least 1"),
    ],
)
def test_bad_engine_arguments_fail_start_up(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["sim", "--port", "0", "--profile", "tiny", *argv])
    assert code == 1
    assert fragment in capsys.readouterr().err


def test_argparse_refuses_unknown_choices(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["sim", "--profile", "h100"], ["sim", "--flavor", "tgi"], ["sim", "--role", "x"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
        assert "invalid choice" in capsys.readouterr().err


def test_sglang_switches_adapters_keys_and_faults_reach_the_engines() -> None:
    sglang = cli.cluster_from_args(
        parse(
            [
                "sim",
                "--flavor",
                "sglang-0.5.23",
                "--schedule-low-priority-values-first",
                "--lora-modules",
                "a",
                "b",
                "--api-key",
                "k",
                "--fault-slow",
                "0.5",
                "--fault-stall",
                "3",
            ]
        )
    )
    engine = sglang.engines[0]
    assert engine.flavor == "sglang" and not engine.metrics_enabled
    assert engine.low_priority_first and engine.lora_modules == ("a", "b")
    assert engine.api_key == "k"
    assert engine.faults.config.slow == 0.5 and engine.faults.config.stall == 3


def test_a_tokenizer_file_is_used_for_counting_and_blocks(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {
        "[UNK]": 0,
        **{w: i + 1 for i, w in enumerate(["the", "sea", "is", "wide", "and", "deep"])},
    }
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    cluster = cli.cluster_from_args(parse(["sim", "--tokenizer-file", str(path)]))
    loaded = cluster.engines[0].model.tokenizer
    assert isinstance(loaded, FileTokenizer)
    text = "the sea is wide and deep " * 3  # 18 words, one token each
    assert loaded.count(text) == 18
    assert list(loaded.ids("the sea")) == [1, 2]
    encoded = loaded.encode(text, 4)
    assert encoded.num_tokens == 18 and len(encoded.block_payloads) == 4
    assert encoded.block_payloads[0] == b"".join(i.to_bytes(4, "little") for i in (1, 2, 3, 4))
