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
* latency: median and p99 of 400 sequential chat requests through a gateway in front of 4
  `instant` simulated engines, with kv_events off, then on (engines publishing, gateway
  subscribed, `sim` tokenizer) with the pre-routing wait off (`route_budget_ms: 0`) and on
  (the default budget), each after 50 warm-up requests. Two workloads: `turns`
  (conversations of 5 turns sharing a preamble: the bridge knows each prompt to near its
  end, no wait) and `new` (every prompt opens with text never seen: each decision waits for
  its prompt's tokenization), with the count of each wait outcome.

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

from gateway.keys import route_request
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.config import DEFAULT_ROUTE_BUDGET_MS
from gateway.kvevents.evidence import EventEvidence
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex
from gateway.kvevents.render import HFRenderer, Renderer, SimRenderer
from gateway.kvevents.stage import learn_prompt
from gateway.kvevents.tokcache import TokenCache
from gateway.kvevents.wire import BlockStored
from gateway.sim.server import KVEventsOptions
from gateway.sim.tokenizer import approx_token_ids, render_chat
from gateway.testing.servers import gateway, sim_engines
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


def bpe_rows(tokens: int) -> None:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        print("next turn, BPE: skipped (no tokenizers package)")
        return
    rng = random.Random(7)
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
    sample = _words(rng, 5000, vocab)
    per_word = len(tok.encode(sample).ids) / 5000
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


async def latency(
    events: bool, requests: int, budget_ms: float, fresh: bool
) -> tuple[float, float, dict[str, int]]:
    async with sim_engines(4, "instant", kv_events=KVEventsOptions()) as engines:
        sources = [
            {
                "replica": f"e{e.index}",
                "endpoint": e.kv_publisher.endpoint,  # type: ignore[union-attr]
                "replay_endpoint": e.kv_publisher.replay_endpoint,
                "topic": "kv-events",
            }  # type: ignore[union-attr]
            for e in engines
        ]
        tokenizer = {"kind": "sim", "route_budget_ms": budget_ms}
        kv = {"enabled": events, "sources": sources, "tokenizer": tokenizer}
        async with gateway(engines, kv_events=kv) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            times = []
            for i in range(requests + 50):
                body = chat(300, turn=i % 5)
                body["messages"][1]["content"] += f" session {i // 5}"
                if fresh:
                    body["messages"][0]["content"] = (
                        f"request {i}: " + body["messages"][0]["content"]
                    )
                body["max_tokens"] = 4
                t0 = time.perf_counter()
                r = await http.post("/v1/chat/completions", json=body)
                dt = time.perf_counter() - t0
                assert r.status_code == 200, r.text
                if i >= 50:
                    times.append(dt)
            waits: dict[str, int] = {}
            for family in gw.state.metrics.registry.collect():
                for sample in family.samples:
                    if sample.name == "kvgate_kv_route_waits_total":
                        waits[sample.labels["outcome"]] = int(sample.value)
            times.sort()
            return statistics.median(times), times[int(0.99 * len(times))], waits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="prompt size of the CPU figures")
    ap.add_argument("--requests", type=int, default=400, help="timed requests per latency run")
    ap.add_argument("--cpu-only", action="store_true", help="skip the latency runs")
    args = ap.parse_args()
    cpu_figures(args.tokens)
    if args.cpu_only:
        return 0
    runs = [(False, 0.0), (True, 0.0), (True, DEFAULT_ROUTE_BUDGET_MS)]
    for workload in ("turns", "new"):
        for events, budget in runs * 2:
            p50, p99, waits = asyncio.run(latency(events, args.requests, budget, workload == "new"))
            name = f"on, budget {budget:g} ms" if events else "off"
            shown = ", ".join(f"{k} {v}" for k, v in sorted(waits.items()))
            print(
                f"request path, 1 client, {workload}, events {name}: "
                f"p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"
                + (f" (waits: {shown})" if shown else "")
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
