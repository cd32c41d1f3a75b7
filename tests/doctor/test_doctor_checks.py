"""The checks on literal expositions: no engine needed to know what each number means."""

from __future__ import annotations

from gateway.doctor.checks import diagnose
from gateway.doctor.findings import Hints
from gateway.doctor.probe import EngineSnapshot, parse_engine, parse_gateway

VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{engine="0",model_name="m"}} {pre}
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {gen}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",gpu_memory_utilization="0.92",\
num_gpu_blocks="{blocks}",engine="0"}} 1.0
"""


def snap(
    at: float,
    *,
    running: int = 2,
    waiting: int = 0,
    usage: float = 0.5,
    pre: int = 0,
    prompt: int = 100,
    gen: int = 10,
    blocks: str = "1000",
) -> EngineSnapshot:
    text = VLLM.format(
        running=running,
        waiting=waiting,
        usage=usage,
        pre=pre,
        prompt=prompt,
        gen=gen,
        blocks=blocks,
    )
    return parse_engine("http://e", text, at)


def test_cache_config_info_and_counters() -> None:
    s = snap(0.0, pre=3)
    assert (s.num_gpu_blocks, s.block_size, s.gpu_memory_utilization) == (1000, 16, 0.92)
    assert s.kv_capacity_tokens == 16_000
    assert s.counters == {"preemptions": 3, "prompt_tokens": 100, "generation_tokens": 10}
    # Before profiling vLLM labels num_gpu_blocks "None": capacity unknown, not zero.
    assert snap(0.0, blocks="None").num_gpu_blocks is None


def test_old_preemptions_only_warn_and_a_restart_is_not_negative() -> None:
    old = diagnose({"http://e": [snap(0.0, pre=5), snap(1.0, pre=5, prompt=200)]}, None, Hints())
    (f,) = old.findings
    assert f.code == "preemptions" and f.severity == "warning"
    # Counters went backwards (restart): the new totals are the delta.
    restarted = diagnose(
        {"http://e": [snap(0.0, pre=50, usage=0.95), snap(1.0, pre=2, usage=0.95, prompt=300)]},
        None,
        Hints(),
    )
    (g,) = restarted.findings
    assert g.severe and "2 in the last 1.0 s" in g.evidence[0]


def test_frozen_counters_while_running_are_stale() -> None:
    d = diagnose({"http://e": [snap(0.0), snap(2.0)]}, None, Hints())
    assert [f.code for f in d.findings] == ["stale_metrics"]
    idle = diagnose({"http://e": [snap(0.0, running=0), snap(2.0, running=0)]}, None, Hints())
    assert idle.findings == ()


def test_expected_hit_rate_without_a_gateway() -> None:
    text = VLLM.format(running=0, waiting=0, usage=0.1, pre=0, prompt=1, gen=1, blocks="10")
    text += 'vllm:prefix_cache_queries_total{engine="0"} 1000\n'
    text += 'vllm:prefix_cache_hits_total{engine="0"} 100\n'
    s = parse_engine("http://e", text, 0.0)
    d = diagnose({"http://e": [s]}, None, Hints(expected_hit_rate=0.8))
    (f,) = d.findings
    assert f.code == "hit_rate_low" and "10.0%" in f.evidence[0]
    fine = diagnose({"http://e": [s]}, None, Hints(expected_hit_rate=0.25))
    assert fine.findings == ()


def test_gateway_view() -> None:
    text = """\
kvgate_scrape_age_seconds{replica="a"} 0.2
kvgate_scrape_age_seconds{replica="b"} 42.0
kvgate_in_flight{replica="a"} 3
kvgate_routing_decisions_total{policy="lineage",reason="sticky"} 90
kvgate_routing_decisions_total{policy="lineage",reason="least_cost"} 10
kvgate_scrape_errors_total{replica="b",reason="connect"} 7
"""
    g = parse_gateway("http://gw", text, 0.0)
    assert g.decisions == {"sticky": 90, "least_cost": 10}
    d = diagnose({}, g, Hints())
    (f,) = d.findings
    assert (f.code, f.replica) == ("stale_metrics", "b")
    assert "42.0 > 10" in f.evidence[0] and "7" in f.evidence[1]
