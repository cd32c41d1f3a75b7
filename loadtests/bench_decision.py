"""Decision cost of the routing policies as the cluster and the prefix index grow.

Times `choose` (and `placed` for prefix_affinity) through the composed router on
synthetic views: 8, 64 and 512 replicas with scraped loads, conversations whose prompts
grow turn by turn, and one run with the index holding ~1M blocks. Prints a table of
microseconds per call (p50 / p99 / mean).

    python loadtests/bench_decision.py [--decisions 3000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

# Runnable from a checkout without installing: the repository root holds gateway/ and plugins/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.policy import PolicyContext, TracksPrefill
from gateway.prefill_meter import PrefillMeter
from gateway.routing import RoutingSettings, build_router
from gateway.types import ClusterView, EngineLoad, ReplicaId, ReplicaState, RouteRequest, SessionKey

BLOCK_TOKENS = 16
MAX_PREFIX_BLOCKS = 1024
METER_SPEED = 14000.0  # prefill tokens/s the metered views' replicas answer at


def make_replicas(n: int, capacity_tokens: int) -> tuple[ReplicaState, ...]:
    return tuple(
        ReplicaState(
            ReplicaId(f"r{i}"),
            f"http://10.0.{i // 250}.{i % 250}:8000",
            kv_capacity_tokens=capacity_tokens,
        )
        for i in range(n)
    )


def make_view(
    states: tuple[ReplicaState, ...],
    rng: random.Random,
    now: float,
    meter: PrefillMeter | None = None,
) -> ClusterView:
    loaded = tuple(
        ReplicaState(
            r.id,
            r.url,
            load=EngineLoad(
                waiting=rng.randint(0, 4),
                running=rng.randint(0, 16),
                kv_usage=rng.random() * 0.9,
                scraped_at=now,
            ),
            kv_capacity_tokens=r.kv_capacity_tokens,
        )
        for r in states
    )
    inflight = {r.id: rng.randint(0, 6) for r in states}
    return ClusterView(loaded, now=now, stale_after=2.0, in_flight=inflight, prefill=meter)


class Workload:
    """Conversations: a shared system prompt, then turns that extend the previous prompt."""

    def __init__(
        self, rng: random.Random, prompt_blocks: int, block_tokens: int = BLOCK_TOKENS
    ) -> None:
        self.rng = rng
        self.block_tokens = block_tokens
        self.prompt_blocks = prompt_blocks
        self.system = [rng.getrandbits(63) for _ in range(8)]
        self.convs: list[list[int]] = []
        self.n = 0

    def next(self) -> RouteRequest:
        rng = self.rng
        self.n += 1
        if not self.convs or rng.random() < 0.3:
            blocks = self.system + [rng.getrandbits(63) for _ in range(self.prompt_blocks)]
            self.convs.append(blocks)
            if len(self.convs) > 2000:
                self.convs.pop(0)
        else:
            blocks = rng.choice(self.convs)
            blocks.extend(rng.getrandbits(63) for _ in range(rng.randint(4, 40)))
        # The gateway hashes at most session.max_prefix_blocks of a prompt.
        hashes = tuple(blocks[:MAX_PREFIX_BLOCKS])
        return RouteRequest(
            request_id=f"q{self.n}",
            model="m",
            session_key=SessionKey(f"s{id(blocks)}"),
            prefix_hashes=hashes,
            block_tokens=self.block_tokens,
            prompt_tokens=len(hashes) * self.block_tokens,
        )


def run(
    policy: str,
    replicas: int,
    decisions: int,
    prompt_blocks: int,
    capacity_tokens: int,
    warm_blocks: int = 0,
    block_tokens: int = BLOCK_TOKENS,
    metered: bool = False,
) -> dict[str, float]:
    """`metered`: the views carry a prefill meter fed as the proxy feeds it (each request's
    first token after its prompt at METER_SPEED), so a policy that reads queued prefill
    in seconds runs that path."""
    rng = random.Random(7)
    meter = PrefillMeter() if metered else None
    states = make_replicas(replicas, capacity_tokens)
    router = build_router(RoutingSettings(policy=policy), PolicyContext(replicas=states))
    work = Workload(rng, prompt_blocks, block_tokens)
    now = 100.0
    view = make_view(states, rng, now, meter)
    placed = router.placed  # type: ignore[attr-defined]
    prefill = router if isinstance(router, TracksPrefill) else None
    # Warm the index up to `warm_blocks` with fresh prompts placed round the cluster
    # (cheaper than routing each one; the index's content is what matters here).
    scorer = router.scorer  # type: ignore[attr-defined]
    index = getattr(scorer, "index", None)
    filler = Workload(random.Random(11), prompt_blocks, block_tokens)
    i = 0
    while index is not None and index.total_blocks < warm_blocks:
        req = filler.next()
        if len(filler.convs) > 50:
            filler.convs.clear()  # fresh conversations: fill, don't deepen
        placed(req, states[i % replicas].id)
        i += 1
    choose_us: list[float] = []
    placed_us: list[float] = []
    for i in range(decisions):
        if i % 50 == 0:
            now += 0.25
            view = make_view(states, rng, now, meter)
        req = work.next()
        t0 = time.perf_counter_ns()
        target = router.choose(req, view).first
        t1 = time.perf_counter_ns()
        assert target is not None
        if prefill is not None:
            prefill.dispatched(req, target)
        placed(req, target)
        if prefill is not None:
            prefill.prefilled(req)
        t2 = time.perf_counter_ns()
        if meter is not None:
            meter.dispatched(req.request_id, target, req.prompt_tokens, now)
            meter.first_token(req.request_id, now + req.prompt_tokens / METER_SPEED)
        choose_us.append((t1 - t0) / 1000.0)
        placed_us.append((t2 - t1) / 1000.0)
    q = statistics.quantiles(choose_us, n=100)
    return {
        "choose_p50": q[49],
        "choose_p99": q[98],
        "choose_mean": statistics.fmean(choose_us),
        "placed_mean": statistics.fmean(placed_us),
        "indexed": float(index.total_blocks) if index is not None else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--prompt-blocks", type=int, default=250, help="first-turn prompt, blocks")
    args = ap.parse_args()
    rows = []
    for policy in ("round_robin", "consistent_hash", "least_load", "prefix_affinity"):
        for n in (8, 64, 512):
            rows.append((policy, n, run(policy, n, args.decisions, args.prompt_blocks, 500_000)))
    # ~1M indexed blocks: 64 replicas x 32k-block (512k-token) capacity, filled before timing.
    big = run(
        "prefix_affinity",
        64,
        args.decisions,
        args.prompt_blocks,
        32_768 * BLOCK_TOKENS,
        warm_blocks=1_000_000,
    )
    rows.append(("prefix_affinity (1M blocks)", 64, big))
    # The default policy with the default 256-token blocks: 100K-token prompts (400
    # blocks), 512 replicas whose indexes hold ~1M blocks in all, filled before timing.
    # Its views carry a prefill meter: the sticky bound is in seconds of queued prefill.
    for n in (8, 64, 512):
        rows.append(
            (
                "lineage",
                n,
                run("lineage", n, args.decisions, 400, 500_000, block_tokens=256, metered=True),
            )
        )
    lineage_big = run(
        "lineage",
        512,
        args.decisions,
        400,
        2048 * 256,
        warm_blocks=1_000_000,
        block_tokens=256,
        metered=True,
    )
    rows.append(("lineage (1M blocks)", 512, lineage_big))
    # `cost` (seconds to the first token; its views carry no prefill meter here, so every
    # replica counts alike): the same shape as the default's rows.
    for n in (8, 512):
        rows.append(("cost", n, run("cost", n, args.decisions, 400, 500_000, block_tokens=256)))
    print(
        f"{'policy':30} {'replicas':>8} {'p50 us':>9} {'p99 us':>9} {'mean us':>9} "
        f"{'placed us':>10} {'indexed':>9}"
    )
    for policy, n, r in rows:
        print(
            f"{policy:30} {n:>8} {r['choose_p50']:>9.1f} {r['choose_p99']:>9.1f} "
            f"{r['choose_mean']:>9.1f} {r['placed_mean']:>10.1f} {int(r['indexed']):>9}"
        )


if __name__ == "__main__":
    main()
