"""What the KV event path costs: tokenization and lookup CPU for a 100K-token prompt, and
the request path's latency with events on and off at one client.

* tokenize: the tokenizer stage's work on one finished 100K-token chat request (sim
  renderer: the simulated engines' template and tokenizer), off the event loop;
* next turn: the same stage's work on that conversation's next turn, tokenized whole or
  incrementally (the token cache holding the previous turn), with the sim renderer and
  with a real tokenizer (a byte-level BPE of 8000 tokens trained here on random words, a
  ChatML template; no download);
* lookup: `CacheEvidence.cached_tokens` for that prompt's next turn against an index where
  8 synced replicas hold it, with 64 other requests in flight (the memo defeated: a fresh
  request each time);
* latency: median and p99 of 300 sequential chat requests (after 30 warm-up ones) through
  a gateway (`kvgate serve`, its own process, as in production) in front of 4 simulated
  engines (another process, 1000x faster than an H200, publishing KV events throughout),
  with kv_events off, then on (`sim` tokenizer) in threads and in worker processes, each
  with the pre-routing wait off (`route_budget_ms: 0`) and at its default. Workloads:
  `turns` (conversations of 5 turns of ~300 tokens sharing a preamble: the bridge knows
  each prompt to near its end, no wait), `new` (every prompt opens with text never seen:
  each decision waits for its prompt's tokenization) and `new-20k` (the same with 20K-token
  prompts). A gateway with events on joins engines that have served the earlier rows: its
  timed requests start once it has resolved its join of each engine's stream (replayed
  the history, or cleared it where the engine's buffer has rolled over; printed as
  `join`), so the rows are the steady state. Rounds are interleaved (`--rounds`, each in its own
  order); each row prints the median p50 and its min..max, the median p99, and what
  events add to the p50 of `off`.

    python loadtests/bench_kvevents_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from bench_lineage import Running
from bench_overhead import free_port
from bench_policies import start_engines
from bench_routers import answers_chat
from prometheus_client.parser import text_string_to_metric_families

from gateway.keys import route_request
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.config import DEFAULT_ROUTE_BUDGET_MS
from gateway.kvevents.evidence import EventEvidence
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex
from gateway.kvevents.learn import learn_prompt
from gateway.kvevents.render import HFRenderer, Renderer, SimRenderer
from gateway.kvevents.tokcache import TokenCache
from gateway.kvevents.wire import BlockStored
from gateway.sim.tokenizer import approx_token_ids, render_chat
from gateway.types import Endpoint, ReplicaId

MODEL = "kvgate-sim"


def chat(tokens: int, turn: int = 0) -> dict[str, Any]:
    msgs = [
        {"role": "system", "content": "agent tools " * 200},
        {"role": "user", "content": ("read file and report " * (tokens // 5))[: tokens * 4]},
    ]
    for t in range(turn):
        msgs += [
            {"role": "assistant", "content": f"done {t}"},
            {"role": "user", "content": f"next {t}"},
        ]
    return {"model": MODEL, "messages": msgs}


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _cpu_ms(fn: Callable[[], object], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1e3


def next_turn_row(
    name: str,
    make: Callable[[TokenCache | None], Renderer],
    first: dict[str, Any],
    nxt: dict[str, Any],
) -> None:
    request = route_request(nxt, Endpoint.CHAT, "n", block_tokens=512, max_prefix_blocks=2048)
    whole = make(None)

    def learn(renderer: Renderer) -> None:
        learn_prompt(renderer, nxt, Endpoint.CHAT, request.prefix_hashes, 2048, 16)

    whole_ms = _cpu_ms(lambda: learn(whole))
    times = []
    for _ in range(5):
        cache = TokenCache()
        renderer = make(cache)
        renderer.render(first, Endpoint.CHAT)  # the previous turn, tokenized before
        times.append(_cpu_ms(lambda r=renderer: learn(r), runs=1))  # type: ignore[misc]
    got = make(TokenCache())
    got.render(first, Endpoint.CHAT)
    inc = got.render(nxt, Endpoint.CHAT)
    ref = whole.render(nxt, Endpoint.CHAT)
    assert inc is not None and ref is not None and inc.reuse == "hit"
    assert list(inc.token_ids) == list(ref.token_ids)
    print(
        f"next turn, {name} ({len(ref.token_ids) // 1000}K tokens, {len(ref.token_ids) - inc.reused} re-tokenized): "
        f"whole {whole_ms:.1f} ms, incremental {statistics.median(times):.1f} ms CPU (worker thread)"
    )


def _words(rng: random.Random, n: int, vocab: list[str]) -> str:
    return " ".join(rng.choice(vocab) + rng.choice(("", "", "", ",", ".", "\n")) for _ in range(n))


def train_bpe(rng: random.Random, what: str) -> tuple[Any, list[str], float] | None:
    """A byte-level BPE of 8000 tokens trained on random words, those words, and its tokens
    per word; None (saying that `what` is skipped) without the tokenizers package."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        print(f"{what}: skipped (no tokenizers package)")
        return None
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_words(rng, 200, vocab) for _ in range(1000)], trainer)
    return tok, vocab, len(tok.encode(_words(rng, 5000, vocab)).ids) / 5000


def bpe_rows(tokens: int) -> None:
    rng = random.Random(7)
    trained = train_bpe(rng, "next turn, BPE")
    if trained is None:
        return
    tok, vocab, per_word = trained
    system = _words(rng, 2000, vocab)
    user = _words(rng, int(tokens / per_word), vocab)
    first = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    nxt = {
        "model": MODEL,
        "messages": first["messages"]
        + [
            {"role": "assistant", "content": _words(rng, 60, vocab)},
            {"role": "user", "content": _words(rng, 150, vocab)},
        ],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "tokenizer.json")
        tok.save(path)
        next_turn_row(
            "byte-level BPE", lambda cache: HFRenderer(path, CHATML, {}, cache, 16), first, nxt
        )


def cpu_figures(tokens: int) -> None:
    body = chat(tokens)
    request = route_request(body, Endpoint.CHAT, "r", block_tokens=512, max_prefix_blocks=2048)
    renderer = SimRenderer()
    runs = []
    for _ in range(5):
        t0 = time.process_time()
        learnt = learn_prompt(renderer, body, Endpoint.CHAT, request.prefix_hashes, 2048, 16)
        runs.append(time.process_time() - t0)
    assert learnt is not None
    hashes, keys, counts = learnt
    print(
        f"tokenize+key {tokens // 1000}K-token prompt ({len(keys)} blocks): {statistics.median(runs) * 1e3:.1f} ms CPU (worker thread)"
    )
    next_turn_row("sim", lambda cache: SimRenderer(cache, 16), body, chat(tokens, turn=1))
    bpe_rows(tokens)
    index = EventIndex()
    ids = approx_token_ids(render_chat(body["messages"]))
    n = len(ids) // 16
    feed = EventFeed(index)
    bridge = PromptBridge()
    bridge.learn(hashes, keys, counts)
    for i in range(8):
        rid = ReplicaId(f"e{i}")
        feed.reset(rid, True, "start")
        index.apply(
            rid, [BlockStored(tuple(range(1, n + 1)), None, tuple(ids[: n * 16]), 16, None, "GPU")]
        )
    evidence = EventEvidence(index, feed, bridge, {"GPU": 1.0})
    # Requests in flight meanwhile (each counted where it went until it ends): 8 a replica,
    # sharing the prompt's system message.
    for i in range(64):
        other = chat(tokens // 4)
        other["messages"][1]["content"] = f"in flight {i} " + other["messages"][1]["content"]
        sent = route_request(
            other, Endpoint.CHAT, f"f{i}", block_tokens=512, max_prefix_blocks=2048
        )
        evidence.dispatched(sent, ReplicaId(f"e{i % 8}"), other)
    nxt = chat(tokens, turn=1)
    reqs = [
        route_request(nxt, Endpoint.CHAT, f"q{i}", block_tokens=512, max_prefix_blocks=2048)
        for i in range(50)
    ]
    t0 = time.process_time()
    for r in reqs:
        answer = evidence.cached_tokens(r)
    per = (time.process_time() - t0) / len(reqs)
    assert answer is not None
    print(
        f"lookup of its next turn, 8 replicas holding {min(answer.values())} tokens each: {per * 1e3:.2f} ms CPU per request"
    )
    t0 = time.process_time()
    for r in reqs:
        route_request(nxt, Endpoint.CHAT, r.request_id, block_tokens=512, max_prefix_blocks=2048)
    print(
        f"  (for scale: building its RouteRequest costs {(time.process_time() - t0) / len(reqs) * 1e3:.2f} ms)"
    )


# A workload: (prompt tokens, every prompt opens with text never seen).
WORKLOADS: dict[str, tuple[int, bool]] = {
    "turns": (300, False),
    "new": (300, True),
    "new-20k": (20_000, True),
}
# (name, events on, tokenizer executor, pre-routing budget in ms, intake: process | thread)
Config = tuple[str, bool, str, float, str]


def configs(executors: list[str], intakes: list[str]) -> list[Config]:
    """Events off, then on with each tokenizer executor x budget (0, the default) x intake
    (named only when more than one is asked for)."""
    out: list[Config] = [("off", False, "process", 0.0, "process")]
    for executor in executors:
        for budget in (0.0, DEFAULT_ROUTE_BUDGET_MS):
            for intake in intakes:
                name = f"on, {executor}, budget {budget:g}"
                if len(intakes) > 1:
                    name += f", intake {intake}"
                out.append((name, True, executor, budget, intake))
    return out


def gateway_yaml(port: int, urls: list[str], kv: list[tuple[str, str]], config: Config) -> str:
    _, events, executor, budget, intake = config
    lines = [f"server:\n  port: {port}\n  log_level: warning\nreplicas:"]
    lines += [f"  - {{id: e{i}, url: '{u}', models: [{MODEL}]}}" for i, u in enumerate(urls)]
    lines.append("models:\n  discover: false")
    if events:
        lines.append(
            f"kv_events:\n  enabled: true\n  intake: {intake}\n"
            f"  tokenizer: {{kind: sim, executor: {executor}, route_budget_ms: {budget:g}}}\n"
            "  sources:"
        )
        lines += [
            f"    - {{replica: e{i}, endpoint: '{pub}', replay_endpoint: '{replay}', "
            "topic: kv-events}"
            for i, (pub, replay) in enumerate(kv)
        ]
    return "\n".join(lines) + "\n"


def serve(tmp: str, yaml_for: Callable[[int], str]) -> tuple[Running, str]:
    """`kvgate serve` with the YAML `yaml_for(port)` gives, once it answers a chat."""
    port = free_port()
    cfg = Path(tmp) / f"gw-{port}.yaml"
    cfg.write_text(yaml_for(port))
    gw = Running([sys.executable, "-m", "gateway.cli", "serve", "-c", str(cfg)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while (error := answers_chat(url, 1.0)) is not None:
        if gw.proc.p.poll() is not None or time.monotonic() > deadline:
            gw.stop()
            raise RuntimeError(f"gateway did not start: {gw.why_dead()} {error}")
    return gw, url


LAG_LATE_S = ("0.005", "0.01")  # bucket bounds of kvgate_event_loop_lag_seconds reported


async def loop_lag(http: httpx.AsyncClient) -> dict[str, float]:
    """The gateway's loop-lag histogram: wake-ups in all (`count`) and per bucket bound."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families((await http.get("/metrics")).text):
        if family.name == "kvgate_event_loop_lag_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    out[sample.labels["le"]] = sample.value
                elif sample.name.endswith("_count"):
                    out["count"] = sample.value
    return out


def late(before: dict[str, float], after: dict[str, float]) -> tuple[float, ...]:
    """(wake-ups, those later than each of LAG_LATE_S) between two readings."""
    count = after.get("count", 0.0) - before.get("count", 0.0)
    within = [after.get(b, 0.0) - before.get(b, 0.0) for b in LAG_LATE_S]
    return (count, *(count - w for w in within))


async def latency(
    url: str, requests: int, workload: str, round_: int, events: bool
) -> tuple[float, float, float | None, tuple[float, ...]]:
    """p50 and p99 of `requests` sequential chat requests (after 30 warm-up ones), with
    events on how long the gateway took to join the engines' event streams, and the
    gateway's loop-lag wake-ups over the timed requests (`late`)."""
    tokens, fresh = WORKLOADS[workload]
    n = 0

    def body() -> dict[str, Any]:
        nonlocal n
        b = chat(tokens, turn=n % 5)
        b["messages"][1]["content"] += f" session {n // 5}"
        if fresh:
            b["messages"][0]["content"] = (
                f"round {round_} request {n}: " + b["messages"][0]["content"]
            )
        b["max_tokens"] = 4
        n += 1
        return b

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        join = await warmed(http, body, 30, events)
        lag0 = await loop_lag(http)
        times = []
        for _ in range(requests):
            b = body()
            t0 = time.perf_counter()
            r = await http.post("/v1/chat/completions", json=b)
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        lag = late(lag0, await loop_lag(http))
    times.sort()
    return statistics.median(times), times[int(0.99 * len(times))], join, lag


async def warmed(
    http: httpx.AsyncClient, body: Callable[[], dict[str, Any]], count: int, events: bool
) -> float | None:
    """`count` warm-up requests, then with events on the wait for the join (`joined`)."""

    async def warm() -> None:
        r = await http.post("/v1/chat/completions", json=body())
        assert r.status_code == 200, r.text

    for _ in range(count):
        await warm()
    return await joined(http, warm, 4) if events else None


async def joined(http: httpx.AsyncClient, warm: Callable[[], Any], engines: int) -> float:
    """Seconds until the gateway has resolved its join of every engine (replayed its history,
    or cleared it when the engine's buffer no longer reaches back to its first batch) and
    applied what it replayed. A join resolves on the engine's next batch when the buffer
    has rolled over, so `warm()` sends a request meanwhile."""
    t0 = time.monotonic()
    last, since = -1, t0
    while time.monotonic() - t0 < 120:
        text = (await http.get("/metrics")).text
        resolved: set[str] = set()
        batches = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvgate_kv_events_resyncs_total" and sample.value:
                    resolved.add(sample.labels["replica"])
                elif sample.name == "kvgate_kv_events_batches_total":
                    batches += sample.value
        now = time.monotonic()
        if batches != last:
            last, since = int(batches), now
        if len(resolved) < engines:
            await warm()
        elif now - since >= 0.5:
            return since - t0
        await asyncio.sleep(0.05)
    raise RuntimeError("the gateway did not join every engine's event stream")


def latency_rows(requests: int, rounds: int, workloads: list[str], configs: list[Config]) -> None:
    """Each configuration's gateway (`kvgate serve`, its own process) in front of the same 4
    engines (another process, publishing KV events throughout), rounds interleaved."""
    engines = start_engines(4, 64_000, time_scale=1000.0, kv_events=True)
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    lags: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    joins: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(rounds):
                for workload in workloads:
                    # Each round in another order: no configuration always runs first.
                    for config in random.Random(round_).sample(configs, len(configs)):
                        gw, url = serve(
                            tmp,
                            lambda port, c=config: gateway_yaml(  # type: ignore[misc]
                                port, engines.urls, engines.kv, c
                            ),
                        )
                        try:
                            p50, p99, join, lag = asyncio.run(
                                latency(url, requests, workload, round_, config[1])
                            )
                        finally:
                            gw.stop()
                        results.setdefault((workload, config[0]), []).append((p50, p99))
                        lags.setdefault((workload, config[0]), []).append(lag)
                        if join is not None:
                            joins.append(join)
    finally:
        engines.stop()
    print(
        f"join: {len(joins)} gateways with events on joined the 4 engines' streams in a "
        f"median of {statistics.median(joins):.2f} s after warm-up (max {max(joins):.2f})"
    )
    for workload in workloads:
        base = statistics.median(r[0] for r in results[(workload, "off")])
        for config in configs:
            runs = results[(workload, config[0])]
            p50s = [r[0] * 1e3 for r in runs]
            p99 = statistics.median(r[1] for r in runs) * 1e3
            added = statistics.median(p50s) - base * 1e3
            print(
                f"request path, 1 client, {workload}, events {config[0]}: p50 "
                f"{statistics.median(p50s):.2f} ms ({min(p50s):.2f}..{max(p50s):.2f}), "
                f"p99 {p99:.2f} ms" + (f", p50 added {added:+.2f} ms" if config[1] else "")
            )
            wakes = [sum(x) for x in zip(*lags[(workload, config[0])], strict=True)]
            print(
                f"  loop lag over the timed requests, {len(runs)} rounds: {wakes[0]:.0f} "
                "wake-ups, "
                + ", ".join(
                    f"{n:.0f} later than {float(b) * 1e3:g} ms"
                    for b, n in zip(LAG_LATE_S, wakes[1:], strict=True)
                )
            )


async def _stall(url: str, bodies: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """(latencies of /health probes sent every 5 ms while `bodies` are sent one by one,
    latencies of those requests)."""
    probes: list[float] = []
    sent: list[float] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def probe() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                await http.get("/health")
                probes.append(time.perf_counter() - t0)
                await asyncio.sleep(0.005)

        task = asyncio.create_task(probe())
        for b in bodies:
            t0 = time.perf_counter()
            r = await http.post("/v1/chat/completions", json=b)
            assert r.status_code == 200, r.text
            sent.append(time.perf_counter() - t0)
        done.set()
        await task
    return probes, sent


def stall_rows(tokens: int, prompts: int) -> None:
    """How long the gateway stops answering while a real tokenizer (the BPE above, `hf`
    kind) tokenizes new `tokens`-token prompts whole, in a thread and in a worker process."""
    rng = random.Random(11)
    trained = train_bpe(rng, "stall")
    if trained is None:
        return
    tok, vocab, per_word = trained
    engines = start_engines(4, 64_000, time_scale=1000.0, kv_events=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path, template = Path(tmp) / "tokenizer.json", Path(tmp) / "template.jinja"
            tok.save(str(path))
            template.write_text(CHATML)
            hf = f"kind: hf, path: '{path}', chat_template: '{template}',"
            for executor in ("thread", "process"):

                def yaml_for(port: int, executor: str = executor) -> str:
                    text = gateway_yaml(
                        port, engines.urls, engines.kv, ("", True, executor, 0.0, "process")
                    )
                    return text.replace("kind: sim,", hf)

                bodies = [
                    {
                        "model": MODEL,
                        "messages": [
                            {"role": "user", "content": _words(rng, int(tokens / per_word), vocab)}
                        ],
                        "max_tokens": 4,
                    }
                    for _ in range(prompts)
                ]
                gw, url = serve(tmp, yaml_for)
                try:
                    probes, sent = asyncio.run(_stall(url, bodies))
                finally:
                    gw.stop()
                probes.sort()
                print(
                    f"stall, hf tokenizer in a {executor}, {prompts} new {tokens // 1000}K-token "
                    f"prompts: /health p50 {statistics.median(probes) * 1e3:.2f} ms, p99 "
                    f"{probes[int(0.99 * len(probes))] * 1e3:.2f} ms, max {probes[-1] * 1e3:.1f} ms "
                    f"({len(probes)} probes); the prompts' own p50 "
                    f"{statistics.median(sent) * 1e3:.1f} ms"
                )
    finally:
        engines.stop()


def intake_rows(rounds: int, prompts: int = 600) -> None:
    """How long the gateway stops answering while engines publish the events of new
    20K-token prompts (1250 blocks stored, 1250 evicted each), with the intake in a thread
    and in its own process: /health probed every 5 ms while the prompts are sent one by one
    (sim tokenizer in a thread, no pre-routing wait, after the join)."""
    engines = start_engines(4, 64_000, time_scale=1000.0, kv_events=True)
    found: dict[str, list[tuple[float, float, float, float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(rounds):
                rows = [("off", False), ("thread", True), ("process", True)]
                for intake, events in random.Random(round_).sample(rows, len(rows)):
                    config: Config = (
                        intake,
                        events,
                        "thread",
                        0.0,
                        intake if events else "process",
                    )
                    gw, url = serve(
                        tmp,
                        lambda port, c=config: gateway_yaml(  # type: ignore[misc]
                            port, engines.urls, engines.kv, c
                        ),
                    )
                    try:
                        probes, sent = asyncio.run(_intake_stall(url, round_, prompts, events))
                    finally:
                        gw.stop()
                    probes.sort()
                    found.setdefault(intake, []).append(
                        (
                            statistics.median(probes),
                            probes[int(0.99 * len(probes))],
                            probes[-1],
                            statistics.median(sent),
                        )
                    )
    finally:
        engines.stop()
    for intake, runs in found.items():
        p50, p99, top, own = (sorted(r[i] * 1e3 for r in runs) for i in range(4))
        print(
            f"intake stall, events {'off' if intake == 'off' else 'on, intake ' + intake}, "
            f"{prompts} new 20K-token prompts: /health p50 {statistics.median(p50):.2f} ms, "
            f"p99 {statistics.median(p99):.2f} ms ({p99[0]:.2f}..{p99[-1]:.2f}), max "
            f"{statistics.median(top):.1f} ms; the prompts' p50 {statistics.median(own):.2f} ms"
        )


async def _intake_stall(
    url: str, round_: int, prompts: int, events: bool
) -> tuple[list[float], list[float]]:
    n = 0

    def body() -> dict[str, Any]:
        nonlocal n
        b = chat(20_000)
        b["messages"][0]["content"] = f"stall {round_} {n}: " + b["messages"][0]["content"]
        b["max_tokens"] = 4
        n += 1
        return b

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await warmed(http, body, 10, events)
    return await _stall(url, [body() for _ in range(prompts)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="prompt size of the CPU figures")
    ap.add_argument("--requests", type=int, default=300, help="timed requests per latency run")
    ap.add_argument("--rounds", type=int, default=3, help="latency runs per configuration")
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="latency workloads (comma-separated)"
    )
    ap.add_argument("--cpu-only", action="store_true", help="skip the latency runs")
    ap.add_argument("--latency-only", action="store_true", help="skip the CPU figures")
    ap.add_argument(
        "--stall-tokens", type=int, default=60_000, help="prompt size of the stall rows (0: none)"
    )
    ap.add_argument(
        "--executors", default="thread,process", help="tokenizer executors of the latency rows"
    )
    ap.add_argument(
        "--intakes",
        default="process",
        help="KV event intakes of the latency rows (process, thread or both: rows for each)",
    )
    ap.add_argument(
        "--intake-rounds",
        type=int,
        default=0,
        help="rounds of the intake stall rows (/health while new 20K-token prompts' events "
        "flow; 0: none)",
    )
    args = ap.parse_args()
    if not args.latency_only:
        cpu_figures(args.tokens)
    if not args.cpu_only:
        rows = configs(args.executors.split(","), args.intakes.split(","))
        if args.workloads:
            latency_rows(
                args.requests, args.rounds, [w for w in args.workloads.split(",") if w], rows
            )
        if args.stall_tokens:
            stall_rows(args.stall_tokens, prompts=6)
        if args.intake_rounds:
            intake_rows(args.intake_rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
