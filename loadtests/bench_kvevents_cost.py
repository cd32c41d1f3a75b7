"""What the KV event path costs: tokenization and lookup CPU for a 100K-token prompt, and
the request path's latency with events on and off at one client.

* tokenize: the tokenizer stage's work on one finished 100K-token chat request (sim
  renderer: the simulated engines' template and tokenizer), off the event loop;
* lookup: `CacheEvidence.cached_tokens` for that prompt's next turn against an index where
  8 synced replicas hold it, with 64 other requests in flight (the memo defeated: a fresh
  request each time);
* latency: median and p99 of 400 sequential chat requests through a gateway in front of 4
  `instant` simulated engines, with kv_events off, then on (engines publishing, gateway
  subscribed, `sim` tokenizer), each after 50 warm-up requests.

    python loadtests/bench_kvevents_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from gateway.keys import route_request
from gateway.kvevents.bridge import PromptBridge
from gateway.kvevents.evidence import EventEvidence
from gateway.kvevents.feed import EventFeed
from gateway.kvevents.index import EventIndex
from gateway.kvevents.render import SimRenderer
from gateway.kvevents.stage import learn_prompt
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


async def latency(events: bool, requests: int) -> tuple[float, float]:
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
        kv = {"enabled": events, "sources": sources, "tokenizer": {"kind": "sim"}}
        async with gateway(engines, kv_events=kv) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            times = []
            for i in range(requests + 50):
                body = chat(300, turn=i % 5)
                body["messages"][1]["content"] += f" session {i // 5}"
                body["max_tokens"] = 4
                t0 = time.perf_counter()
                r = await http.post("/v1/chat/completions", json=body)
                dt = time.perf_counter() - t0
                assert r.status_code == 200, r.text
                if i >= 50:
                    times.append(dt)
            times.sort()
            return statistics.median(times), times[int(0.99 * len(times))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000, help="prompt size of the CPU figures")
    ap.add_argument("--requests", type=int, default=400, help="timed requests per latency run")
    args = ap.parse_args()
    cpu_figures(args.tokens)
    for events in (False, True, False, True):
        p50, p99 = asyncio.run(latency(events, args.requests))
        print(
            f"request path, 1 client, events {'on ' if events else 'off'}: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
