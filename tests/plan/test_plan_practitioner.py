"""`kvgate plan` on a practitioner's worked cases (issue 46): a MIG slice, and fp4 weights
that still split in the checkpoint's quantisation blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.plan.cards import load_cards
from gateway.plan.catalogue import get_model
from gateway.plan.fit import Target, suggest
from gateway.plan.memory import EngineSettings, budget

SLICE = (
    "cards:\n  h100-mig-3g40: {memory_gib: 39.5, bandwidth_tbs: 1.5, bf16_tflops: 420,"
    ' fp8: native, fp8_tflops: 840, max_tp: %d, note: "MIG 3g.40gb slice"}\n'
)


def cards(tmp_path: Path, max_tp: int) -> Path:
    path = tmp_path / f"cards{max_tp}.yaml"
    path.write_text(SLICE % max_tp)
    return path


def test_a_mig_slice_is_never_offered_tensor_parallelism(tmp_path: Path) -> None:
    model, target = get_model("llama-3.1-8b"), Target(context=131072, concurrency=4)
    mig = load_cards(cards(tmp_path, 1))["h100-mig-3g40"]
    whole = load_cards(cards(tmp_path, 16))["h100-mig-3g40"]
    settings = EngineSettings(max_model_len=131072)
    # The same memory as a card that can span: two cards would be a fix.
    assert "tensor_parallel_size" in {f.setting for f in suggest(model, whole, settings, target)}
    offered = {f.setting for f in suggest(model, mig, settings, target)}
    assert "tensor_parallel_size" not in offered
    tp2 = budget(model, mig, EngineSettings(tp=2))
    assert not tp2.fits and "runs at most tp 1" in tp2.issues[-1].message


def test_a_mig_slice_with_no_fix_says_a_larger_slice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(cards(tmp_path, 1))
    argv = ["plan", "llama-3.1-8b", "--cards-file", path, "--card", "h100-mig-3g40"]
    assert main([*argv, "--context", "131072", "--concurrency", "8"]) == 1
    out = capsys.readouterr().out
    assert "fix: tensor_parallel_size" not in out
    assert "a larger slice or a whole card (it cannot span cards: max_tp 1)" in out


def test_fp4_weights_keep_the_quantisation_block_split_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "plan",
        "qwen3-235b-a22b-fp8",
        "--card",
        "h200",
        "--tp",
        "8",
        "--max-model-len",
        "32768",
    ]
    for weights in ("fp8", "fp4"):
        assert main([*argv, "--weights", weights]) == 1
        out = capsys.readouterr().out
        assert "IMPOSSIBLE (tp_split): moe_intermediate_size 1536 / tp 8 = 192" in out, weights
    main([*argv, "--weights", "bf16"])  # 16-bit weights have no blocks: tp 8 splits
    assert "tp_split" not in capsys.readouterr().out


def test_a_compressed_or_sparse_kv_can_make_the_split_save_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import orjson

    def handoffs(*extra: str) -> list[dict[str, object]]:
        argv = ["plan", "llama-3.1-70b", "--card", "h100", "--tp", "4", "--prompt", "32000"]
        assert main([*argv, "--link", "100gbe", "--json", *extra]) == 0
        rows: list[dict[str, object]] = orjson.loads(capsys.readouterr().out)["plan"]["handoffs"]
        return rows

    # Dense KV over 100 GbE: 32,000 x 327,680 B take ~0.84 s to move, past pd.auto's budget.
    (dense,) = handoffs()
    assert (dense["disaggregate"], dense["reason"]) == (False, "transfer_over_budget")
    # A compressed KV format moving 4 KiB a token: the transfer is cheap, and the split pays
    # for the decode stall a colocated 32,000-token prefill would cause.
    (compressed,) = handoffs("--kv-bytes-per-token", "4096")
    assert compressed["kv_bytes"] == 32000 * 4096 and compressed["disaggregate"]
    assert compressed["benefit_s"] > compressed["transfer_s"]  # type: ignore[operator]
    # Where sparse attention leaves decode unaffected by prefill, it saves ~nothing: colocated.
    (sparse,) = handoffs("--kv-bytes-per-token", "4096", "--prefill-interference", "0.001")
    assert (sparse["disaggregate"], sparse["reason"]) == (False, "no_benefit")
    assert sparse["benefit_s"] <= sparse["transfer_s"]  # type: ignore[operator]
    assert main(["plan", "llama-3.1-8b", "--prompt", "9000", "--prefill-interference", "2"]) == 2
    assert "0 to 1" in capsys.readouterr().err
