"""Hit rate and TTFT with and without the engines' KV cache events, under eviction pressure.

bench_lineage.py's harness (8 simulated engines in a child process, one router process at a
time, trace replay over HTTP, 3 repeats), with the routers that matter here:

* ``kvgate``: the default routing on its approximate prefix index;
* ``kvgate+events``: the same, subscribed to every engine's ZMQ KV event stream (vLLM's
  wire format, published by the simulated engines) with the `sim` tokenizer stage;
* ``sglang-cache_aware``: the best peer router of bench_lineage's tables (skipped, with the
  reason, when its binary is not in ``--router-bin``).

Every router's engines publish their events (only kvgate+events listens), so that the
engines do the same work in every row. The KV cache is smaller than bench_lineage's (16000 blocks, 256K tokens per engine) so that
engines evict under any routing. Every argument of bench_lineage.py is accepted and wins
over these defaults, e.g.

    python loadtests/bench_kvevents.py                                  # both traces
    python loadtests/bench_kvevents.py --traces agent --requests 300 --repeat 1
    python loadtests/bench_kvevents.py --gateways 2    # two instances of each router
    python loadtests/bench_kvevents.py --traces synthetic --bypass-rate 2 --bypass-engines 2

With ``--gateways 2`` every router runs as two instances in front of the same engines and
the replay alternates between them, as a load balancer in front of a gateway deployment
does: each instance sees half of every conversation's turns, and only the engines' events
tell it what the other half left in the caches.

With ``--bypass-rate`` another client sends prompts to the engines straight (bypass.py)
during each replay: it evicts what the conversations left, which only the events show.
With ``--drop-cache-at F`` the first ``--drop-cache-engines`` engines lose their whole cache
once a fraction F of the arrivals has been replayed, as restarts would.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_lineage

DEFAULTS = {
    "--routers": "kvgate,kvgate+events,sglang-cache_aware",
    "--layouts": "turns",
    "--headers": "without",
    "--repeat": "3",
    "--blocks": "16000",
}


def main() -> int:
    given = {a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--")}
    extra = [x for k, v in DEFAULTS.items() if k not in given for x in (k, v)]
    # Every router's engines publish (the cost of publishing is the engines', whoever listens).
    sys.argv[1:] = ["--engine-events", *extra, *sys.argv[1:]]
    return bench_lineage.main()


if __name__ == "__main__":
    raise SystemExit(main())
