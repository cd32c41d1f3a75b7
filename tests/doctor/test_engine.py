"""The doctor's engine findings on simulated engines with one parameter starved, checked by
what they promise: the figure a suggestion names, applied to the engine, clears the finding,
and a value one step worse keeps it. The numbers come from the finding, not from the test."""

from __future__ import annotations

import re

from gateway.doctor.checks import Diagnosis, diagnose
from gateway.doctor.cli import collect
from gateway.doctor.engine import check_engine
from gateway.doctor.findings import Hints
from gateway.sim.cluster import SimCluster
from gateway.sim.profiles import HardwareProfile, get_profile

TINY = get_profile("tiny")  # 64 blocks x 16 = 1,024 KV tokens


async def diagnose_one(
    profile: HardwareProfile, flavor: str = "vllm", **hints: object
) -> Diagnosis:
    async with SimCluster(1, profile, flavor=flavor) as sim:
        series, view = await collect(sim.urls, None, samples=1, interval=0.0, timeout=5.0)
    return diagnose(series, view, Hints(**hints))  # type: ignore[arg-type]


def suggested(d: Diagnosis, code: str, pattern: str) -> int:
    (f,) = [f for f in d.findings if f.code == code]
    found = re.search(pattern, f.suggestion)
    assert found, f.suggestion
    return int(found.group(1).replace(",", ""))


async def test_the_max_model_len_kv_starved_suggests_is_the_largest_that_clears_it() -> None:
    starved = await diagnose_one(TINY)
    fit = suggested(starved, "kv_starved", r"max_model_len <= ([\d,]+)")
    assert 0 < fit < TINY.max_model_len and fit % 16 == 0  # whole blocks
    cured = await diagnose_one(TINY.scaled(max_model_len=fit))
    assert "kv_starved" not in {f.code for f in cured.findings}, cured.findings
    # One block more and the same engine is starved again: the bound is tight.
    again = await diagnose_one(TINY.scaled(max_model_len=fit + 16))
    assert [f.code for f in again.findings] == ["kv_starved"]
    assert again.findings[0].severity == "warning" and not again.severe


async def test_the_max_num_batched_tokens_suggested_clears_the_finding() -> None:
    big = TINY.scaled(max_num_batched_tokens=1024, max_model_len=512)
    before = await diagnose_one(big, "sglang")
    rec = suggested(before, "max_num_batched_tokens_high", r"max_num_batched_tokens ([\d,]+)")
    assert 0 < rec < 1024 and rec & (rec - 1) == 0  # a power of two, smaller
    after = await diagnose_one(big.scaled(max_num_batched_tokens=rec), "sglang")
    assert "max_num_batched_tokens_high" not in {f.code for f in after.findings}, after.findings


async def test_severity_follows_how_many_full_sequences_fit() -> None:
    # Said by the engine itself (max_model_len from /v1/models), then overridden by the
    # operator's hint: 1 sequence fits is a warning, none is severe.
    fits_once = await diagnose_one(TINY.scaled(max_model_len=1024))
    (f,) = fits_once.findings
    assert (f.code, f.severity) == ("kv_starved", "warning")
    assert "= 1 full-length" in f.evidence[1]
    fits_none = await diagnose_one(TINY.scaled(max_model_len=1024), max_model_len=1040)
    (g,) = fits_none.findings
    assert (g.code, g.severity) == ("kv_starved", "severe") and fits_none.severe
    assert "= 0 full-length" in g.evidence[1]


async def test_an_unreachable_engine_gets_one_finding_and_no_arithmetic() -> None:
    async with SimCluster(1, "instant") as sim:
        url = sim.urls[0]
    series, _ = await collect([url], None, samples=2, interval=0.0, timeout=1.0)
    findings = check_engine(url, series[url], Hints(max_model_len=4096))
    assert [(f.code, f.severity) for f in findings] == [("unreachable", "severe")]
    assert url == findings[0].replica
