"""`kvgate plan` end to end through the CLI: tables, --json, exit codes, files."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from plan_configs import DEEPSEEK_V3, write

from gateway.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_budget_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "llama-3.1-8b",
        "--card",
        "l40s",
        "--max-num-batched-tokens",
        "131072",
        "--context",
        "131072",
        "--json",
    )
    plan = orjson.loads(out)["plan"]
    assert code == 1 and not plan["fits"] and not plan["target"]["met"]
    assert plan["memory_gib"]["activations"] == pytest.approx(17.245, abs=0.001)
    assert plan["suggestions"][0] == {
        **plan["suggestions"][0],
        "setting": "max_num_batched_tokens",
        "value": "32768",
    }
    code, out, _ = run(
        capsys,
        "llama-3.1-8b",
        "--card",
        "l40s",
        "--max-num-batched-tokens",
        "12288",
        "--context",
        "131072",
        "--json",
    )
    plan = orjson.loads(out)["plan"]
    assert code == 0 and plan["fits"] and plan["target"]["met"]
    assert plan["kv_tokens"] == plan["kv_blocks"] * 16


def test_text_table_shows_the_arithmetic(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        "deepseek-r1",
        "--card",
        "h200",
        "--tp",
        "4",
        "--weights",
        "fp4",
        "--weights-gib",
        "106",
        "--max-model-len",
        "131072",
        "--context",
        "131072",
        "--concurrency",
        "2",
        "--prompt",
        "100000",
        "--link",
        "10gbe",
    )
    assert code == 1
    assert "KV cache                                                    15.34" in out
    assert "14,650 blocks of 16 = 234,400 tokens" in out
    assert "target   2 x 131,072 tokens: NOT MET" in out
    assert "fix: enforce_eager=true -> KV 17.46 GiB, 2 sequence(s) fit" in out
    assert "colocated: transfer_over_budget" in out
    code, out, _ = run(
        capsys,
        "deepseek-r1",
        "--card",
        "h200",
        "--tp",
        "4",
        "--weights",
        "fp4",
        "--weights-gib",
        "106",
        "--max-model-len",
        "131072",
        "--context",
        "131072",
        "--concurrency",
        "2",
        "--enforce-eager",
    )
    assert code == 0 and "MET" in out and "CUDA graphs (off: enforce_eager)" in out


def test_impossible_split_from_a_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = dict(DEEPSEEK_V3, moe_intermediate_size=1536)
    path = write(tmp_path, "split", cfg)
    code, out, _ = run(capsys, str(path), "--card", "h200", "--tp", "8", "--max-model-len", "8192")
    assert code == 1
    assert "IMPOSSIBLE (tp_split): moe_intermediate_size 1536 / tp 8 = 192" in out


def test_cards_file_and_listing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cards = tmp_path / "cards.yaml"
    cards.write_text(
        "cards:\n  big-npu: {memory_gib: 512, bandwidth_tbs: 9, bf16_tflops: 900,"
        " fp8: native, fp8_tflops: 1800}\n"
    )
    code, out, _ = run(capsys, "--list-cards", "--cards-file", str(cards))
    assert code == 0 and "big-npu" in out and "ascend-910b" in out and "h200" in out
    code, out, _ = run(
        capsys, "llama-3.1-70b", "--card", "big-npu", "--cards-file", str(cards), "--json"
    )
    assert code == 0 and orjson.loads(out)["plan"]["memory_gib"]["card"] == 512
    cards.write_text("cards:\n  bad: {memory_gib: -1}\n")
    code, _, err = run(capsys, "llama-3.1-8b", "--cards-file", str(cards))
    assert code == 2 and "cards.bad.memory_gib" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nope"], "unknown model 'nope'"),
        (["llama-3.1-8b", "--card", "tpu9"], "unknown card 'tpu9'"),
        (["llama-3.1-8b", "--gpu-memory-utilization", "2"], "gpu_memory_utilization"),
        (["llama-3.1-8b", "--link", "smoke-signals", "--prompt", "9"], "unknown link"),
        (["llama-3.1-8b", "--context", "-5"], "must be positive"),
        ([], "name a model"),
    ],
)
def test_bad_input_is_a_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and message in err


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "budget.png"
    code, _, err = run(capsys, "llama-3.1-8b", "--card", "h100", "--plot", str(png))
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in err
