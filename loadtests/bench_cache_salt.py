"""What per-tenant `cache_salt` costs in prefix-cache hits: tenants sharing one long system
prompt (the case the salt gives up: one tenant's prompt no longer warms another's) and
each asking its own questions, through a gateway with keys on, salt on and off.

    python loadtests/bench_cache_salt.py [--tenants 8] [--requests 12] [--replicas 2]

Prints, per setting, the token-weighted hit rate the engines reported (cached prompt
tokens over prompt tokens) and the cost of the salt in points.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.auth.principal import hash_key
from gateway.testing.servers import gateway, replica_config, sim_engines

MODEL = "kvgate-sim"
SYSTEM = "You are the support assistant of a large retailer. Policies follow. " * 120


async def hit_rate(salted: bool, tenants: int, requests: int, replicas: int) -> float:
    keys = [
        {"name": f"t{i}", "key_sha256": hash_key(f"sk-t{i}"), "tenant": f"t{i}"}
        for i in range(tenants)
    ]
    rng = random.Random(7)
    order = [t for t in range(tenants) for _ in range(requests)]
    rng.shuffle(order)
    async with (
        sim_engines(replicas, "instant") as engines,
        gateway(
            engines,
            auth={"keys": keys, "cache_salt": salted},
            models={"discover": False},
            replicas=replica_config(engines, models=[MODEL]),
        ) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        for n, t in enumerate(order):
            question = f"customer {t}-{n} asks about order {rng.randrange(10**6)}"
            resp = await http.post(
                "/v1/chat/completions",
                headers={"authorization": f"Bearer sk-t{t}"},
                json={
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": 1,
                },
            )
            resp.raise_for_status()
        records = [r for e in engines for r in e.request_log]
    return sum(r.cached_tokens for r in records) / max(1, sum(r.prompt_tokens for r in records))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--requests", type=int, default=12, help="per tenant")
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    off = await hit_rate(False, args.tenants, args.requests, args.replicas)
    on = await hit_rate(True, args.tenants, args.requests, args.replicas)
    print(f"tenants {args.tenants}, {args.requests} requests each, {args.replicas} replicas")
    print(f"hit rate, salt off: {off:.3f}")
    print(f"hit rate, salt on:  {on:.3f}")
    print(f"cost of the salt: {100 * (off - on):.1f} points")


if __name__ == "__main__":
    asyncio.run(main())
