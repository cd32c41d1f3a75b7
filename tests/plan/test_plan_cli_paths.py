"""`kvgate plan` paths the worked cases do not take: pool specs for --compare (and what they
change), --trace windows and files that hold nothing usable, targets no fleet meets, the
card table, the hand-off's own checks; each bad input is one line on stderr and exit 2."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.cli import main
from gateway.plan.cards import get_card
from gateway.plan.catalogue import get_model
from gateway.plan.cli import parse_pool
from gateway.plan.fromtrace import Pool, SimSettings, TraceShape, plan_pool, render
from gateway.plan.memory import EngineSettings, budget
from gateway.trace.format import Trace, TraceHeader, TraceRecord, write_trace

BT = 64


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def small_trace(convs: int = 3, turns: int = 2, prompt_blocks: int = 32) -> Trace:
    recs, t = [], 0.0
    for turn in range(turns):
        for c in range(convs):
            n = prompt_blocks + 8 * turn
            recs.append(TraceRecord(t, n * BT, 8, tuple(c * 1000 + k for k in range(n)), BT))
            t += 0.05
    return Trace(TraceHeader(block_tokens=BT), tuple(recs))


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "trace.jsonl"
    write_trace(path, small_trace())
    return path


def test_pool_specs_parse_and_name_their_keys() -> None:
    assert parse_pool(" card=h100 , tp=2, kv-dtype=fp8,label=a ") == {
        "card": "h100",
        "tp": "2",
        "kv_dtype": "fp8",
        "label": "a",
    }
    with pytest.raises(ValueError, match="use key=value with keys card, gpu_memory_utilization"):
        parse_pool("card=h100,tp")
    with pytest.raises(ValueError, match="use key=value"):
        parse_pool("card=h100,colour=red")
    with pytest.raises(ValueError, match="names no card="):
        parse_pool("tp=2,price=1")


def test_a_compared_pool_takes_each_setting_it_names(
    trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys,
        "llama-3.1-8b",
        "--card",
        "h100",
        "--max-model-len",
        "8192",
        "--weights-gib",
        "16",
        "--trace",
        str(trace_file),
        "--ttft",
        "5",
        "--max-replicas",
        "2",
        "--compare",
        "card=h100,tp=2,kv_dtype=fp8,gpu_memory_utilization=0.8,max_num_seqs=64,label=split",
        "--compare",
        "card=a100,weights=fp8,max_num_batched_tokens=4096,price=0.5",
        "--json",
    )
    assert code == 0, err
    pools = {p["pool"]: p for p in orjson.loads(out)["trace"]["pools"]}
    assert list(pools) == ["h100-tp1", "split", "a100-tp1"]
    assert (
        pools["split"]["tensor_parallel"] == 2 and pools["a100-tp1"]["price_per_card_hour"] == 0.5
    )
    # The measured 16 GiB of weights at tp 1 are 8 GiB a card at tp 2; the fp8 KV halves
    # bytes per token again (Llama 8B: 131,072 B at bf16 tp 1, so 32,768 here), and
    # 0.8 of the card is what is left to share.
    model, h100 = get_model("llama-3.1-8b"), get_card("h100")
    split = budget(
        model,
        h100,
        EngineSettings(
            tp=2,
            kv_dtype="fp8",
            gpu_memory_utilization=0.8,
            max_num_seqs=64,
            max_model_len=8192,
            weights_gib=8.0,
        ),
    )
    assert split.kv_bytes_per_token == 32_768
    assert pools["split"]["kv_tokens_per_replica"] == split.kv_tokens
    a100 = budget(
        model,
        get_card("a100"),
        EngineSettings(
            weight_dtype="fp8", max_num_batched_tokens=4096, max_model_len=8192, weights_gib=16.0
        ),
    )
    assert pools["a100-tp1"]["kv_tokens_per_replica"] == a100.kv_tokens
    # Every pool's replica count meets the target on the same trace.
    assert all(p["needed"]["ttft_p90_s"] <= 5 for p in pools.values())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--start", "100"], "no requests in the chosen window"),
        (["--compare", "card=h100,tp=x"], "invalid literal for int()"),
        (["--compare", "card=tpu9"], "unknown card 'tpu9'"),
        (["--percentile", "p75"], "invalid choice: 'p75'"),
    ],
)
def test_trace_inputs_that_cannot_be_planned(
    trace_file: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["llama-3.1-8b", "--trace", str(trace_file), *extra]
    if extra[0] == "--percentile":
        with pytest.raises(SystemExit) as info:
            run(capsys, *argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err
        return
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "") and message in err and err.startswith("kvgate plan: ")


def test_an_unreadable_or_foreign_trace_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "llama-3.1-8b", "--trace", str(tmp_path / "none.jsonl"))
    assert code == 2 and "cannot read trace" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    code, _, err = run(capsys, "llama-3.1-8b", "--trace", str(bad))
    assert code == 2 and "expected CSV columns" in err


def test_plan_pool_refuses_bad_targets() -> None:
    pool = Pool("x", budget(get_model("llama-3.1-8b"), get_card("h100"), EngineSettings()), 1.0)
    with pytest.raises(ValueError, match="percentile must be one of p50, p90, p99, mean"):
        plan_pool(small_trace(), pool, 1.0, percentile="p75")
    with pytest.raises(ValueError, match="target TTFT must be positive"):
        plan_pool(small_trace(), pool, 0.0)


def test_a_target_no_fleet_meets_says_why(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """One 24K-token prompt's prefill takes longer than the target on any replica count:
    more replicas do not shorten it, so TTFT levels off and the search stops at the cap."""
    trace = small_trace(convs=2, turns=1, prompt_blocks=384)
    settings = EngineSettings(max_model_len=32768)
    pool = Pool("l40s", budget(get_model("llama-3.1-8b"), get_card("l40s"), settings), 1.0)
    plan = plan_pool(trace, pool, 0.01, sim=SimSettings(max_replicas=4))
    assert plan.needed is None
    assert [p.replicas for p in plan.points] == [1, 2, 4]
    text = render(TraceShape.of(trace), [plan], "t.jsonl")
    assert "l40s" in text and "target not met with up to 4 replicas" in text
    assert "TTFT levels off at" in text and "more tensor parallelism does" in text
    assert "Counting output tokens only" not in text  # no pool met the target
    data = plan.as_dict()
    assert data["needed"] is None and len(data["points"]) == 3
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    code, out, _ = run(
        capsys,
        "llama-3.1-8b",
        "--card",
        "l40s",
        "--max-model-len",
        "32768",
        "--trace",
        str(path),
        "--ttft",
        "0.01",
        "--max-replicas",
        "2",
    )
    assert code == 1 and "target not met with up to 2 replicas" in out


def test_render_names_requests_over_the_context_and_impossible_pools() -> None:
    base = small_trace(convs=2, turns=1)
    huge = TraceRecord(base.records[-1].arrival_s + 0.1, 40_000, 4, (), BT)
    trace = Trace(base.header, (*base.records, huge))
    fits = budget(get_model("llama-3.1-8b"), get_card("h100"), EngineSettings(max_model_len=8192))
    ok = plan_pool(trace, Pool("h100", fits, 2.0), 10.0, sim=SimSettings(max_replicas=2))
    never = budget(get_model("deepseek-v3"), get_card("l40s"), EngineSettings())
    impossible = plan_pool(trace, Pool("tiny", never, 1.0), 10.0)
    text = render(TraceShape.of(trace), [ok, impossible], "t")
    assert ok.too_long == 1
    assert "h100: 1 request(s) longer than the engine's context (8,192 tokens" in text
    assert "tiny" in text and "impossible: " in text
    assert "target 10 s with no other errors" in text
    shape = TraceShape.of(trace)
    assert shape.requests == 3 and shape.total_input == 2 * 32 * BT + 40_000


def test_card_table_as_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--list-cards", "--json")
    cards = orjson.loads(out)
    assert code == 0 and cards["h100"]["memory_gib"] == get_card("h100").memory_gib
    assert cards["ascend-910b"]["fp8"] == "none"
    code, out, _ = run(capsys, "--list-cards")
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["card", "GiB", "TB/s"]
    assert [r.split()[0] for r in rows] == sorted(cards)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("cards: [unclosed", "is not YAML"),
        (
            "cards:\n  x: {memory_gib: 10, bandwidth_tbs: 1, bf16_tflops: 9, colour: red}\n",
            "cards.x.colour",
        ),
        ("cards:\n  x: {memory_gib: 10}\n", "cards.x.bandwidth_tbs: Field required"),
        (None, "cannot read cards file"),
    ],
)
def test_bad_cards_files(
    tmp_path: Path, content: str | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cards.yaml"
    if content is not None:
        path.write_text(content)
    code, out, err = run(capsys, "--list-cards", "--cards-file", str(path))
    assert (code, out) == (2, "") and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "1000", "--prefill-interference", "1.5"], "prefill interference is a share"),
        (
            ["--prompt", "1000", "--kv-bytes-per-token", "0"],
            "KV bytes per token must be at least 1",
        ),
        (["--prompt", "0"], "prompt length must be at least 1 token"),
        (["--concurrency", "0", "--context", "1024"], "must be positive"),
        (["--tp", "0"], "tensor parallel degree must be at least 1"),
        (["--block-size", "0"], "block_size must be >= 1"),
    ],
)
def test_bad_engine_and_handoff_numbers(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "llama-3.1-8b", *argv)
    assert (code, out) == (2, "") and message in err


def test_a_config_file_that_is_not_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m" / "config.json"
    path.parent.mkdir()
    path.write_text('{"model_type": "bert", "hidden_size": 768}')
    code, out, err = run(capsys, str(path))
    assert (code, out) == (2, "") and "needs num_hidden_layers" in err
    path.write_text("not json")
    code, _, err = run(capsys, str(path.parent))
    assert code == 2 and "is not JSON" in err
