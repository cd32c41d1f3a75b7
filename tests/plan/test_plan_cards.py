"""Cards: which compute a weight format gets on each (native, dequantised per matmul, or
none), the peak the roofline then uses, and a cards file replacing a built-in card."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.errors import ConfigError
from gateway.plan.cards import builtin_cards, get_card, load_cards
from gateway.plan.catalogue import get_model
from gateway.plan.memory import EngineSettings, budget
from gateway.plan.perf import MFU, speed


@pytest.mark.parametrize(
    ("card", "capability", "peak"),
    [
        ("b200", "fp4", "fp4_tflops"),  # native fp4 tensor cores
        ("b200", "fp8", "fp8_tflops"),
        ("h100", "fp8", "fp8_tflops"),
        ("h100", "fp4", "bf16_tflops"),  # fp4 weights dequantised: the bf16 rate
        ("a100", "fp8", "bf16_tflops"),
        ("ascend-910b", "bf16", "bf16_tflops"),
    ],
)
def test_the_peak_a_weight_format_runs_at(card: str, capability: str, peak: str) -> None:
    c = get_card(card)
    assert c.tflops_for(capability) == getattr(c, peak) > 0


def test_capability_issues_name_the_card_and_the_format() -> None:
    oss = get_model("gpt-oss-120b")  # mxfp4 weights
    on_h100 = budget(oss, get_card("h100"), EngineSettings())
    (note,) = [i for i in on_h100.issues if i.kind == "capability"]
    assert not note.severe
    assert note.message == (
        "h100 has no fp4 tensor cores: mxfp4 weights are dequantised per matmul"
        " (memory saved, compute at the bf16 rate)"
    )
    assert speed(on_h100).prefill_tokens_per_s == pytest.approx(
        get_card("h100").bf16_tflops * 1e12 * MFU / (2 * oss.active_params_per_token)
    )
    on_ascend = budget(oss, get_card("ascend-910b"), EngineSettings())
    (block,) = [i for i in on_ascend.issues if i.kind == "capability"]
    assert block.severe and not on_ascend.fits
    assert block.message == "mxfp4 weights need fp4 support, which ascend-910b lacks"


def test_every_builtin_card_answers_bf16_natively() -> None:
    for name, card in builtin_cards().items():
        assert card.name == name and card.supports("bf16") == "native"
        assert card.memory_gib > 0 and card.bandwidth_tbs > 0 and card.max_tp >= 1
        assert card.supports("no-such-format") == "none"


def test_a_cards_file_replaces_a_builtin_card(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cards.yaml"
    path.write_text(
        "cards:\n  h100: {memory_gib: 94, bandwidth_tbs: 3.9, bf16_tflops: 989,"
        " fp8: native, fp8_tflops: 1979, note: H100 NVL}\n"
    )
    cards = load_cards(path)
    assert cards["h100"].memory_gib == 94 and cards["h100"].note == "H100 NVL"
    assert cards["h200"] == builtin_cards()["h200"]  # the others untouched
    b = budget(get_model("llama-3.1-8b"), cards["h100"], EngineSettings())
    assert b.usable_gib == pytest.approx(94 * 0.9)
    assert main(["plan", "--list-cards", "--cards-file", str(path)]) == 0
    (row,) = [r for r in capsys.readouterr().out.splitlines() if r.startswith("h100 ")]
    assert row.split()[1:3] == ["94", "3.9"]
    with pytest.raises(ConfigError, match="unknown card 'H100-PCIE'"):
        get_card("H100-PCIE", cards)
