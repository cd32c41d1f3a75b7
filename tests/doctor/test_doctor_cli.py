"""`kvgate doctor` in process (its own event loop in a worker thread) against simulated
engines on loopback: the text table and findings, the planned budget from --model/--card,
--expected-hit-rate without a gateway, and every bad argument as exit 2 with one line."""

from __future__ import annotations

import asyncio
import contextlib
import io

import httpx
import orjson
import pytest

from gateway.cli import main
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import get_profile


def doctor(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["doctor", *argv])
    return code, out.getvalue(), err.getvalue()


async def in_thread(*argv: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(doctor, *argv)


async def test_text_report_of_a_starved_and_an_unreachable_engine() -> None:
    async with SimCluster(1, "tiny") as sim:
        url = sim.urls[0]
        code, out, err = await in_thread(url, "--samples", "1")
        assert code == 0 and err == ""  # kv_starved at max_model_len 1,024 is a warning
        header, row, blank, *rest = out.splitlines()
        assert header.split() == [
            "engine", "kind", "running", "waiting", "KV", "KV", "tokens", "max", "len", "hit",
            "preempt",
        ]  # fmt: skip
        # tiny: 64 blocks x 16 = 1,024 KV tokens, max_model_len 1,024, nothing run yet.
        assert row.split() == [url, "vllm", "0", "0", "0%", "1,024", "1,024", "-", "0"]
        assert blank == ""
        assert (
            rest[0]
            == f"[WARNING] kv_starved @ {url}: KV cache too small for the configured max_model_len"
        )
        assert rest[1] == "    KV capacity 64 blocks x 16 = 1,024 tokens"
        assert rest[-1].startswith("    fix: give KV more memory")
        closed = url
    code, out, _ = await in_thread(closed, "--samples", "1", "--timeout", "1")
    assert code == 1
    assert out.splitlines()[1].split(maxsplit=1) == [closed, "unreachable (ConnectError)"]
    assert f"[SEVERE] unreachable @ {closed}: engine did not answer" in out
    code, out, _ = await in_thread(closed, "--samples", "1", "--timeout", "1", "--json")
    report = orjson.loads(out)
    assert code == 1 and report["severe"] is True
    engine = report["engines"][closed]
    assert engine["error"] == "unreachable (ConnectError)" and engine["kind"] is None


async def test_the_planned_budget_prices_max_num_batched_tokens() -> None:
    async with SimCluster(1, "h200-sparse") as sim:  # 640,000 KV tokens
        url = sim.urls[0]
        argv = [url, "--samples", "1", "--max-num-batched-tokens", "500000"]
        code, out, _ = await in_thread(*argv, "--model", "llama-3.1-8b", "--card", "l40s")
        assert code == 0
        assert "max_num_batched_tokens 500,000 (--max-num-batched-tokens)" in out
        # The activations of the tokens above the suggestion (16,384) go to KV instead:
        # 2 bytes x (4 x 4096 + 80 x 128 + 3 x 14336) per token.
        freed = 2 * (4 * 4096 + 80 * 128 + 3 * 14336) * (500_000 - 16_384)
        assert f"{freed / 2**30:.2f} GiB = {freed // 131_072:,} more KV tokens" in out
        # Without the plan: the same finding, without the GiB it would free.
        code, plain, _ = await in_thread(*argv)
        assert code == 0 and "max_num_batched_tokens_high" in plain and "GiB" not in plain


async def test_expected_hit_rate_without_a_gateway() -> None:
    async with SimCluster(2, get_profile("h200-sparse"), time_scale=20.0) as sim:
        async with httpx.AsyncClient(timeout=30) as client:
            for i, url in enumerate(sim.urls * 3):
                r = await client.post(
                    url + "/v1/completions",
                    json={"model": "kvgate-sim", "prompt": f"unique {i} " * 80, "max_tokens": 1},
                )
                assert r.status_code == 200
        code, out, _ = await in_thread(*sim.urls, "--samples", "1", "--expected-hit-rate", "0.9")
        assert code == 0
        assert (
            "[WARNING] hit_rate_low @ cluster: engine prefix hit rate far below the expected" in out
        )
        assert "expected 90% (--expected-hit-rate)" in out
        # Expecting no more than the engines reach says nothing.
        code, out, _ = await in_thread(*sim.urls, "--samples", "1", "--expected-hit-rate", "0.1")
        assert code == 0 and "hit_rate_low" not in out and "no findings" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "name at least one engine URL (or --gateway)"),
        (["http://127.0.0.1:9", "--samples", "0"], "--samples must be >= 1"),
        (["http://127.0.0.1:9", "--interval", "-1"], "--interval >= 0"),
        (["http://127.0.0.1:9", "--model", "llama-3.1-8b"], "--model needs --card"),
        (["http://127.0.0.1:9", "--expected-hit-rate", "1.5"], "a fraction in [0, 1]"),
        (["http://127.0.0.1:9", "--model", "nope", "--card", "h100"], "unknown model 'nope'"),
        (
            ["http://127.0.0.1:9", "--model", "llama-3.1-8b", "--card", "tpu9"],
            "unknown card 'tpu9'",
        ),
        (
            ["http://127.0.0.1:9", "--model", "llama-3.1-8b", "--card", "h100", "--tp", "0"],
            "tensor parallel degree must be at least 1",
        ),
        (
            ["http://127.0.0.1:9", "--model", "llama-3.1-8b", "--card", "h100", "--kv-dtype", "q3"],
            "kv dtype 'q3'",
        ),
    ],
)
def test_bad_arguments_exit_2_before_reading_anything(argv: list[str], message: str) -> None:
    code, out, err = doctor(*argv)
    assert (code, out) == (2, "")
    assert err.startswith("kvgate doctor: ") and message in err and err.count("\n") == 1
