"""The benchmarks are not run by the suite (they take minutes and want a quiet machine),
but each must at least parse and answer --help, so a typo is caught before a long run."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.sim.cluster import SimCluster

LOADTESTS = Path(__file__).resolve().parents[1] / "loadtests"
# locustfile imports locust (gevent monkey-patching): compiled only, never imported.
SCRIPTS = sorted([*LOADTESTS.glob("bench_*.py"), LOADTESTS / "pools_pooled.py"])


def test_every_loadtest_compiles() -> None:
    for path in sorted(LOADTESTS.glob("*.py")):
        compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_answers_help(script: Path) -> None:
    done = _script(script.name, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def _module(name: str) -> Any:
    """A loadtests module by file name (the directory is not a package)."""
    spec = importlib.util.spec_from_file_location(name, LOADTESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class body runs.
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def _script(name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run loadtests/`name` with `args` in a child interpreter, output captured."""
    return subprocess.run(
        [sys.executable, str(LOADTESTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _run(ttfts: dict[str, list[float]], cost: dict[str, float]) -> dict[str, Any]:
    results = [
        {
            "phase": ph,
            "pool": "domestic",
            "ttft": t,
            "ok": True,
            "uncached": 0,
            "at": 0.0,
            "sid": "s",
        }
        for ph, ts in ttfts.items()
        for t in ts
    ]
    return {
        "results": results,
        "cost": {ph: {"all": [c, 1000, 10, 1, 990, 900]} for ph, c in cost.items()},
    }


def test_pooled_verdict_takes_p99_and_cost_over_every_seed(tmp_path: Path, capsys: Any) -> None:
    pooled = _module("pools_pooled")
    fast, slow = [0.1] * 99, [0.1] * 98 + [0.5, 0.5]
    # Seed 1's dynamic low phase loses on its own (p99 of 100 = the slowest, 0.4 s vs
    # 0.3 s); pooled over 200 requests its one slow request falls above the p99.
    s1 = {
        "static": _run(
            {"low": [0.1] * 99 + [0.3], "peak": fast, "low-2": fast},
            {"low": 1.0, "peak": 1.0, "low-2": 1.0},
        ),
        "dynamic": _run(
            {"low": fast + [0.4], "peak": fast, "low-2": fast},
            {"low": 0.8, "peak": 1.2, "low-2": 0.9},
        ),
    }
    s2 = {
        "static": _run(
            {"low": [0.1] * 99 + [0.3], "peak": slow, "low-2": fast},
            {"low": 1.0, "peak": 1.0, "low-2": 1.0},
        ),
        "dynamic": _run(
            {"low": fast + [0.1], "peak": fast, "low-2": fast},
            {"low": 0.7, "peak": 1.0, "low-2": 0.6},
        ),
    }
    paths = []
    for seed, runs in ((1, s1), (2, s2)):
        path = tmp_path / f"d{seed}.json"
        path.write_bytes(orjson.dumps({"seed": seed, "phases": [], "runs": runs}))
        paths.append(str(path))
    assert pooled.figures([s1["dynamic"], s2["dynamic"]], "low")[:2] == (0.1, 0.75)
    pooled.main(paths)
    out = capsys.readouterr().out
    assert "all three targets met in 1 of 2 runs" in out
    pooled_lines = out.split("pooled verdict")[1].splitlines()
    low = next(x for x in pooled_lines if x.startswith("low "))
    assert "cost +25.0% lower" in low and "0.100 vs 0.300 s" in low
    assert low.endswith("static): MET")
    low2 = next(x for x in pooled_lines if x.startswith("low-2"))
    assert "cost +25.0% lower" in low2 and low2.endswith("static): MET")


def test_router_comparison_runs_kvgate_and_reports_missing_routers(tmp_path: Path) -> None:
    lean = tmp_path / "lean.yaml"
    lean.write_text("metrics:\n  tokens: false\n")
    done = _script(
        "bench_routers.py",
        *("--routers", "kvgate,vllm,sglang,floor", "--router-bin", str(tmp_path)),
        *("--variant", f"lean={lean}"),
        *("--levels", "1", "--modes", "plain", "--duration", "0.4", "--warmup", "0.1"),
        *("--repeat", "1"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    table = done.stdout.split("CPU per request over kvgate's", 1)[0]
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split()}
    # router conc stream req/s p50 p99 +p50 ratio CPUus xRust err
    assert rows["kvgate"][1:3] == ["1", "False"] and float(rows["kvgate"][3]) > 0
    # One short round's added p50 may come out either side of zero: only its presence is checked.
    assert math.isfinite(float(rows["kvgate"][6])) and rows["kvgate"][-1] == "0"  # no errors
    assert float(rows["kvgate"][8]) > 0  # its CPU was measured
    # The floor (kvgate's server and client alone) answered every request too.
    assert float(rows["floor"][3]) > 0 and float(rows["floor"][8]) > 0 and rows["floor"][-1] == "0"
    # The variant ran in the same rounds, and is set against kvgate round by round.
    assert float(rows["lean"][3]) > 0 and rows["lean"][-1] == "0"
    paired = done.stdout.split("round by round (median, min-max):", 1)[1].splitlines()
    lean_row = next(line.split() for line in paired if line.split()[:1] == ["lean"])
    low, high = (float(x) for x in lean_row[4].split("-"))
    assert lean_row[1:3] == ["1", "False"] and low <= float(lean_row[3]) <= high
    assert "skipped vllm: vllm-router is not installed" in done.stdout
    assert "skipped sglang: sglang_router is not importable" in done.stdout
    # kvgate's cell against the previous release's figures in docs/scale.md.
    assert "Against the previous release" in done.stdout
    against = done.stdout.split("Against the previous release", 1)[1].splitlines()
    cell = next(line.split() for line in against if line.split()[:2] == ["False", "1"])
    assert float(cell[2]) > 0 and math.isclose(
        float(cell[4]), float(cell[2]) / float(cell[3]), rel_tol=0.02
    )


def test_router_comparison_reads_the_previous_release_from_the_docs(tmp_path: Path) -> None:
    sys.path.insert(0, str(LOADTESTS))
    try:
        routers = _module("bench_routers")
    finally:
        sys.path.remove(str(LOADTESTS))
    release, cells = routers.previous_release()
    assert release and set(cells) == {(s, c) for s in (False, True) for c in (1, 32)}
    assert all(cell["cpu"] > 0 and cell["xrust"] > 0 for cell in cells.values())
    doc = tmp_path / "scale.md"
    doc.write_text(
        f"text\n{routers.PREVIOUS_MARKER}\n| release | mode | clients | CPU | x | p50 | r |\n"
        "|---|---|---|---|---|---|---|\n| abc | stream | 32 | 300 | 2.5 | 1.0 | 0.8 |\n\nafter\n"
        "| abc | plain | 1 | 9 | 9 | 9 | 9 |\n"
    )
    assert routers.previous_release(doc) == (
        "abc",
        {(True, 32): {"cpu": 300.0, "xrust": 2.5, "added": 1.0, "ratio": 0.8}},
    )
    doc.write_text("no marker\n")
    assert routers.previous_release(doc) == ("", {})


def test_lineage_benchmark_help_names_its_routers_and_cells() -> None:
    done = _script("bench_lineage.py", "--help")
    assert done.returncode == 0, done.stderr
    flat = "".join(done.stdout.split())  # argparse wraps lines at hyphens
    for name in (
        "kvgate",
        "sglang-cache_aware",
        "sglang-manual",
        "vllm-consistent_hash",
        "vllm-cache_aware",
        "--kvgate-policy",
        "growing",
        "turns",
        "--check-sticky",
    ):
        assert name in flat


def test_windows_benchmark_simulates_both_policies_on_every_window(tmp_path: Path) -> None:
    # A small Mooncake trace: conversations whose turns extend their opening's hash ids.
    trace = tmp_path / "mooncake.jsonl"
    rows = []
    for i in range(40):
        session, turn = i % 8, i // 8
        hashes = [1000 * session + b for b in range(4 + 2 * turn)]
        rows.append(
            {
                "timestamp": 400 * i,
                "input_length": 512 * len(hashes),
                "output_length": 32,
                "hash_ids": hashes,
            }
        )
    trace.write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    args = ["--trace", str(trace), "--starts", "0,10", "--requests", "30"]
    args += ["--agent-seeds", "2", "--agent-requests", "40", "--blocks", "4000"]
    done = _script("bench_windows.py", *args, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    windows = [x.split() for x in lines if x.startswith(("synthetic ", "agent "))]
    assert [w[1] for w in windows] == ["#0", "#10", "seed"]
    for w in windows:
        mean, p99, hit = (float(x) for x in w[-3:])
        assert mean > 0 and p99 > 0 and math.isfinite(hit)
    assert any(
        x.startswith("synthetic: lineage over cache_aware, geometric mean of 2") for x in lines
    )
    assert any(x.startswith("agent: lineage over cache_aware, geometric mean of 1") for x in lines)
    wrong = _script("bench_windows.py", "--policies", "lineage")
    assert wrong.returncode == 2 and "--policies takes two names" in wrong.stderr


def test_bench_windows_runs_the_shapes_and_compares_a_policy_with_itself() -> None:
    args = ["--starts", "", "--agent-seeds", "", "--shape-seeds", "1", "--shape-requests", "40"]
    args += ["--blocks", "4000", "--policies", "lineage,lineage"]
    done = _script("bench_windows.py", *args, "--config-b", '{"cache_weight": 1.0}', timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rows = [x.split() for x in lines if x.startswith(("forks ", "samples ", "rag "))]
    assert [(r[0], r[2]) for r in rows] == [("forks", "1"), ("samples", "1"), ("rag", "1")]
    for shape in ("forks", "samples", "rag"):
        assert any(
            x.startswith(f"{shape}: lineage over lineage, geometric mean of 1") for x in lines
        )
    # The second policy is built with the settings given: an invalid one stops the run.
    bad = _script("bench_windows.py", *args, "--config-b", '{"cache_weight": -1}', timeout=120)
    assert bad.returncode != 0 and "cache_weight" in bad.stderr
    wrong = _script("bench_windows.py", "--config-a", "[1]")
    assert wrong.returncode == 2 and "a policy config is a JSON object" in wrong.stderr


async def test_bypass_sends_unshared_prompts_to_the_chosen_engines_only() -> None:
    bypass = _module("bypass")
    async with SimCluster(3, "h200-sparse", time_scale=20.0) as sim:
        stop = asyncio.Event()
        load = bypass.BypassLoad(rate=40.0, tokens=2048, engines=2)
        task = asyncio.create_task(bypass.send_bypass(sim.urls, load, sim.model, stop))
        await asyncio.sleep(0.5)
        stop.set()
        count = await task
        stats = [e.model.stats for e in sim.engines]
    assert count.sent >= 10 and count.ok == count.sent and count.failed == 0
    # Both chosen engines in turn, the third never; every prompt fully uncached.
    assert stats[0].prompt_tokens > 0 and stats[1].prompt_tokens > 0
    assert stats[2].prompt_tokens == 0
    assert stats[0].prompt_tokens + stats[1].prompt_tokens >= count.sent * 2048
    assert stats[0].prefix_hits == stats[1].prefix_hits == 0


async def test_bypass_skips_an_engine_that_falls_behind() -> None:
    bypass = _module("bypass")
    # A slow engine (a tenth of real time): one open request at a time, the rest skipped.
    async with SimCluster(1, "h200-sparse", time_scale=0.1) as sim:
        stop = asyncio.Event()
        load = bypass.BypassLoad(rate=50.0, tokens=4096, engines=0, max_open=1)
        task = asyncio.create_task(bypass.send_bypass(sim.urls, load, sim.model, stop))
        await asyncio.sleep(0.4)
        stop.set()
        count = await task
    assert count.sent >= 1 and count.skipped >= 5
    assert count.ok == count.sent
    assert "skipped behind 1 unanswered" in count.label(load, 1)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--drop-cache-at", "1.5"], "--drop-cache-at is a fraction"),
        (["--drop-cache-at", "0.5", "--drop-cache-engines", "9"], "--drop-cache-engines 1..8"),
        (["--bypass-rate", "-1"], "--bypass-rate and --bypass-engines must not be negative"),
    ],
)
def test_lineage_benchmark_refuses_bad_disturbances(extra: list[str], says: str) -> None:
    done = _script("bench_lineage.py", *extra)
    assert done.returncode == 2 and says in done.stderr


def test_lineage_benchmark_flags_kvgates_replicas_for_engine_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--engine-priority`: the YAML kvgate is started with flags every replica, and the
    gateway's own loader reads it so."""
    import yaml

    from gateway.settings import load_settings

    monkeypatch.syspath_prepend(str(LOADTESTS))  # its sibling modules
    bench = _module("bench_lineage")
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    for priority in (False, True):
        text = bench.kvgate_yaml(8000, urls, None, 2.0, priority=priority)
        settings = load_settings(**yaml.safe_load(text))
        assert [r.priority_scheduling for r in settings.replicas] == [priority, priority]
        assert settings.engine_priority.shortest_prefill_first


def test_lineage_benchmark_reports_the_imbalance_of_uncached_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two imbalances: of prompt tokens per engine, and of the prefill each engine did
    (its prefix-cache queries minus hits over the replay), the one issue 45 judges."""
    from gateway.trace.report import Percentiles, ReplayReport

    monkeypatch.syspath_prepend(str(LOADTESTS))
    bench = _module("bench_lineage")
    before = bench.Counters((100.0, 100.0), (10.0, 10.0), 90.0, 110.0, 0.0, 0.0)
    # Equal prompt tokens; engine 0 prefilled 3000 of them, engine 1 only 1000.
    after = bench.Counters((2100.0, 2100.0), (3010.0, 1010.0), 90.0, 4110.0, 0.0, 0.0)
    ttft = Percentiles(1.0, 1.0, 1.0, 1.0)
    report = ReplayReport(2, 2, 0, 10.0, ttft, ttft, 4000, 10, 1.0, 1.0, 0.5)
    figures = bench.figures(report, after.minus(before), None, 1.0)
    assert figures["imbalance"] == pytest.approx(1.0)
    assert figures["imbal_unc"] == pytest.approx(1.5)


def test_lineage_benchmark_runs_kvgate_as_the_epp_behind_envoy_with_the_same_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`kvgate+epp`: the same YAML as `kvgate`'s plus the EPP's port, started as `kvgate epp`."""
    import argparse

    import yaml

    from gateway.settings import load_settings

    monkeypatch.syspath_prepend(str(LOADTESTS))
    bench = _module("bench_lineage")
    spec = bench.parse_router("kvgate-cost+epp")
    assert (spec.kind, spec.policy, spec.epp, spec.events) == ("kvgate", "cost", True, False)
    with pytest.raises(ValueError, match=r"\+epp"):
        bench.parse_router("sglang-cache_aware+epp")
    urls = ["http://127.0.0.1:9001"]
    plain = bench.kvgate_yaml(8000, urls, "cost", 2.0)
    as_epp = bench.kvgate_yaml(8000, urls, "cost", 2.0, epp_port=9002)
    settings = load_settings(**yaml.safe_load(as_epp))
    assert settings.epp.port == 9002
    assert load_settings(**yaml.safe_load(plain)).model_dump(exclude={"epp"}) == (
        settings.model_dump(exclude={"epp"})
    )
    args = argparse.Namespace(kv_route_budget_ms=None, engine_priority=False, kvgate_extra=None)
    cmd = bench.router_command(spec, urls, 8000, 2.0, args, tmp_path, epp_port=9002)
    assert isinstance(cmd, list) and cmd[3:5] == ["epp", "-c"]
    assert yaml.safe_load(Path(cmd[5]).read_text())["epp"] == {"port": 9002}


def test_lineage_tails_splits_a_forks_run_by_kind_and_measures_the_queue_met(
    tmp_path: Path, capsys: Any
) -> None:
    tails = _module("lineage_tails")
    bench = _module("bench_lineage")
    args = {"requests": 200, "blocks": bench.BLOCKS, "max_output_tokens": 1024}
    shape = tails.ShapeOptions(shape="forks", seed=1, sessions=96, duration_s=120.0)
    trace, _ = bench.fitting(tails.generate_shape(shape).window(0, 200), bench.BLOCKS, 1024)
    n = len(trace.records)
    kind_of = tails.kinds(trace.records, 96, 1)
    assert {"main1", "main+", "chat1"} <= set(kind_of)
    # Every request on e0 takes 100 s to its first token, so each one met the uncached
    # prefill of every request that arrived before it; e1's (first token at once) nothing.
    replicas = ["e0" if i % 2 == 0 else "e1" for i in range(n)]
    ttfts = [100.0 if r == "e0" else 0.0 for r in replicas]
    run = {
        "router": "kvgate",
        "cell": "forks",
        "repeat": 0,
        "ttft_s": ttfts,
        "cached": [0] * n,
        "replicas": replicas,
        "skipped": None,
    }
    path = tmp_path / "runs.json"
    path.write_text(orjson.dumps({"args": args, "runs": [run]}).decode())
    assert tails.main([str(path), "--trace", "forks", "--slowest", "1"]) == 0
    out = capsys.readouterr().out
    assert "main1" in out and "max/mean" in out
    reqs = tails.requests_of(run, trace, kind_of, 3.0, 1.5)
    last_e0 = max(i for i in range(n) if replicas[i] == "e0")
    ahead = sum(trace.records[i].input_tokens for i in range(0, last_e0, 2))
    assert tails.queued_ahead(reqs, last_e0, "e0") == ahead
    assert tails.queued_ahead(reqs, last_e0, "e1") == 0


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (Debian: valgrind)")
def test_instruction_counts_kvgate_under_callgrind_and_reports_a_missing_router(
    tmp_path: Path,
) -> None:
    done = _script(
        "bench_instructions.py",
        *("--targets", "kvgate,vllm", "--router-bin", str(tmp_path), "--modes", "plain"),
        *("--requests", "5", "--warmup", "2", "--rounds", "2", "--idle-s", "0.3"),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("kvgate"))
    # name mode median (min..max) ratio: a request through kvgate runs a few hundred
    # thousand instructions at least (parsing, routing, relaying), and the first target's
    # ratio to itself is 1.
    assert row[1] == "plain" and int(row[2].replace(",", "")) > 100_000
    assert row[-1] == "x1.000"
    assert "vllm     skipped: not installed" in done.stdout


def test_bounds_of_the_generated_shapes_and_a_run_placed_on_them(tmp_path: Path) -> None:
    first = _script("bench_bounds.py", "--traces", "samples")
    assert first.returncode == 0, first.stderr
    requests = int(first.stdout.split("samples: ", 1)[1].split()[0])
    # A samples run that put every request on one engine: its placement loses nothing.
    run = {
        "router": "kvgate",
        "cell": "samples / growing / without header",
        "repeat": 0,
        "figures": {"hit": 0.9},
        "replicas": ["e0"] * requests,
    }
    runs = tmp_path / "runs.json"
    runs.write_bytes(orjson.dumps({"runs": [run]}))
    done = _script("bench_bounds.py", "--traces", "forks,samples", "--runs", str(runs))
    assert done.returncode == 0, done.stderr
    bounds: dict[str, float] = {}
    name = ""
    for line in done.stdout.splitlines():
        if line.startswith(("forks:", "samples:")):
            name = line.split(":")[0]
        elif line.strip().startswith("infinite"):
            bounds[name] = float(line.split()[1].rstrip("%"))
    assert set(bounds) == {"forks", "samples"} and all(0 < b < 100 for b in bounds.values())
    placed = [x.split() for x in done.stdout.splitlines() if x.startswith("kvgate #1")]
    assert len(placed) == 1 and float(placed[0][4].rstrip("%")) == bounds["samples"]
    wrong = _script("bench_bounds.py", "--traces", "nosuch")
    assert wrong.returncode == 2 and "unknown trace" in wrong.stderr


def _lineage_runs(path: Path, speed: float, runs: list[tuple[str, str, list[float]]]) -> Path:
    """A `bench_lineage.py --json` file: (router, cell, [hit, mean, p99, imbalance]) each."""
    keys = ("hit", "ttft_mean", "ttft_p99", "imbal_unc")
    path.write_bytes(
        orjson.dumps(
            {
                "args": {"prefill_speed": speed},
                "runs": [
                    {"router": router, "cell": cell, "skipped": None, "figures": dict(zip(keys, f))}
                    for router, cell, f in runs
                ],
            }
        )
    )
    return path


def test_lineage_judge_compares_medians_with_the_best_peer_of_each_cell(tmp_path: Path) -> None:
    """Each figure against the best peer, header or not, whichever peer that is; the
    imbalance judged only under the heavier load; a skipped run leaves no figures."""
    bare, sent = "forks / growing / without header", "forks / growing / with header"
    full = _lineage_runs(
        tmp_path / "full.json",
        1.0,
        [
            ("kvgate", bare, [0.82, 1.00, 4.0, 1.9]),
            ("kvgate", bare, [0.80, 1.20, 6.0, 1.9]),
            ("kvgate", bare, [0.81, 1.10, 5.0, 1.9]),
            ("sglang-cache_aware", bare, [0.80, 2.00, 5.0, 1.1]),
            ("vllm-consistent_hash", sent, [0.79, 1.25, 9.0, 1.1]),
        ],
    )
    half = _lineage_runs(
        tmp_path / "half.json",
        0.5,
        [
            ("kvgate", bare, [0.80, 2.0, 8.0, 1.30]),
            ("sglang-manual", sent, [0.81, 4.0, 9.0, 1.20]),
        ],
    )
    done = _script("judge_lineage.py", str(full), str(half))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # Full speed: hit 81% >= 80%; mean 1.10 = 0.88x the header peer's 1.25; p99 5.0 = 1.00x
    # the cache-aware peer's 5.0; no imbalance target.
    assert "met      hit 81.0% against 80.0% (sglang-cache_aware)" in out
    assert "met      mean 1.10 s = 0.880x 1.25 (vllm-consistent_hash, header)" in out
    assert "NOT met  p99 5.00 s = 1.000x 5.00 (sglang-cache_aware)" in out
    assert "| kvgate | without | 3 | 81.0 (80.0..82.0) | 1.10 (1.00..1.20) |" in out
    # Half speed: hit below the peer's; mean 0.50x, p99 8.0 <= 0.9 x 9.0; imbalance over 1.25.
    assert "NOT met  hit 80.0% against 81.0% (sglang-manual, header)" in out
    assert "NOT met  imbalance 1.30; target 1.25" in out
    assert "forks / growing, prefill x0.5" in out
    assert out.rstrip().endswith("4 of 7 targets met (medians over the repeats)")


def test_lineage_judge_says_what_it_cannot_judge(tmp_path: Path) -> None:
    cell = "agent / turns / without header"
    only = _lineage_runs(tmp_path / "a.json", 1.0, [("kvgate", cell, [0.8, 1.0, 2.0, 1.1])])
    done = _script("judge_lineage.py", str(only))
    assert done.returncode == 0 and "no peer runs: nothing judged" in done.stdout
    peers = _lineage_runs(tmp_path / "b.json", 1.0, [("sglang-manual", cell, [0.8, 1.0, 2.0, 1.1])])
    done = _script("judge_lineage.py", str(peers))
    assert "no runs of kvgate without a header" in done.stdout
    cell_without_layout = '{"runs": [{"cell": "agent", "router": "kvgate", "figures": {"hit": 1}}]}'
    for n, text in enumerate(("{}", "[]", cell_without_layout)):
        (bad := tmp_path / f"bad{n}.json").write_text(text)
        done = _script("judge_lineage.py", str(bad))
        assert done.returncode == 2 and "cannot read the runs" in done.stderr, text
