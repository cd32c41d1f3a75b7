from __future__ import annotations

import pytest

from gateway.scrape.adapters import (
    CounterState,
    MetricsFormatError,
    index_samples,
    read_engine,
    select_read_samples,
)
from gateway.scrape.config import EngineKind

VLLM_DP2 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 4.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="qwen"} 0.3
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="qwen"} 600.0
vllm:prefix_cache_queries_total{engine="1",model_name="qwen"} 400.0
vllm:prefix_cache_queries_created{engine="0",model_name="qwen"} 1.7e9
vllm:prefix_cache_queries_created{engine="1",model_name="qwen"} 1.7e9
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="qwen"} 300.0
vllm:prefix_cache_hits_total{engine="1",model_name="qwen"} 200.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",num_gpu_blocks="500"} 1.0
"""

VLLM_OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 8.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 2.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.75
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="llama"} 50.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="llama"} 10.0
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 5.0
sglang:num_running_reqs{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="1"} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 7.0
sglang:num_queue_reqs{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="1"} 7.0
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 0.28
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 0.6
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 200000.0
"""

TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 3
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 6
# TYPE tgi_request_count counter
tgi_request_count 42
"""


def test_vllm_sums_dp_ranks_and_averages_usage() -> None:
    r = read_engine(VLLM_DP2)
    assert r.kind is EngineKind.VLLM
    assert (r.waiting, r.running) == (5.0, 5.0)
    assert r.kv_usage == pytest.approx(0.4)
    assert r.prefix_hit_rate == pytest.approx(0.5)
    assert r.kv_capacity_tokens == 1500 * 16


def test_vllm_old_names_are_read() -> None:
    r = read_engine(VLLM_OLD, EngineKind.VLLM)
    assert (r.waiting, r.running, r.kv_usage) == (2.0, 8.0, 0.75)
    assert r.prefix_hit_rate == pytest.approx(0.2)
    assert r.kv_capacity_tokens is None


def test_vllm_hit_rate_comes_from_counter_deltas() -> None:
    first = read_engine(VLLM_DP2)
    assert first.counters == CounterState(500.0, 1000.0, 0.5)
    later = VLLM_DP2.replace(
        'hits_total{engine="0",model_name="qwen"} 300.0',
        'hits_total{engine="0",model_name="qwen"} 390.0',
    )
    later = later.replace(
        'queries_total{engine="0",model_name="qwen"} 600.0',
        'queries_total{engine="0",model_name="qwen"} 700.0',
    )
    r = read_engine(later, previous=first.counters)
    assert r.prefix_hit_rate == pytest.approx(0.9)  # 90 of the last 100 tokens hit


def test_vllm_counter_reset_uses_new_totals() -> None:
    restarted = CounterState(hits=10_000.0, queries=20_000.0, rate=0.5)
    r = read_engine(VLLM_OLD, previous=restarted)
    assert r.prefix_hit_rate == pytest.approx(0.2)


def test_no_new_queries_keeps_last_rate() -> None:
    first = read_engine(VLLM_OLD)
    again = read_engine(VLLM_OLD, previous=CounterState(10.0, 50.0, 0.33))
    assert first.prefix_hit_rate == pytest.approx(0.2) and again.prefix_hit_rate == 0.33


def test_unprofiled_cache_config_is_unknown_capacity() -> None:
    text = (
        VLLM_OLD
        + '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    )
    assert read_engine(text).kv_capacity_tokens is None


def test_sglang_counts_tp_ranks_once() -> None:
    r = read_engine(SGLANG)
    assert r.kind is EngineKind.SGLANG
    assert (r.waiting, r.running) == (7.0, 5.0)
    assert (r.kv_usage, r.prefix_hit_rate, r.kv_capacity_tokens) == (0.28, 0.6, 200000)


def test_sglang_sums_dp_ranks() -> None:
    text = "# TYPE sglang:num_queue_reqs gauge\n# TYPE sglang:num_running_reqs gauge\n"
    for dp in ("0", "1"):
        for tp in ("0", "1"):
            labels = f'{{dp_rank="{dp}",model_name="q",tp_rank="{tp}"}}'
            text += f"sglang:num_queue_reqs{labels} 7\nsglang:num_running_reqs{labels} 5\n"
    r = read_engine(text, EngineKind.SGLANG)
    assert (r.waiting, r.running) == (14.0, 10.0)


def test_tgi_has_queue_and_batch_but_no_kv() -> None:
    r = read_engine(TGI)
    assert (r.kind, r.waiting, r.running, r.kv_usage, r.prefix_hit_rate) == (
        EngineKind.TGI,
        3.0,
        6.0,
        None,
        None,
    )


def test_detection_and_errors() -> None:
    assert select_read_samples(SGLANG)[1] is EngineKind.SGLANG
    assert select_read_samples("# TYPE up gauge\nup 1\n")[1] is None
    with pytest.raises(MetricsFormatError, match="no vLLM"):
        read_engine("# TYPE up gauge\nup 1\n")
    with pytest.raises(MetricsFormatError, match="missing"):
        read_engine(SGLANG, EngineKind.VLLM)
    with pytest.raises(MetricsFormatError, match="unparseable"):
        read_engine("vllm:num_requests_running{engine=0 3\n")


def test_created_series_are_ignored() -> None:
    assert "vllm:prefix_cache_queries_created" not in index_samples(VLLM_DP2)


@pytest.mark.parametrize("text", [VLLM_DP2, VLLM_OLD, SGLANG, TGI])
def test_reading_only_the_used_lines_changes_nothing(text: str) -> None:
    from gateway.scrape.adapters import READERS

    noise = (
        "# HELP vllm:e2e_request_latency_seconds Latency.\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        + "".join(
            f'vllm:e2e_request_latency_seconds_bucket{{le="{b}"}} {i}\n'
            for i, b in enumerate(("0.1", "1.0", "+Inf"))
        )
        + "vllm:e2e_request_latency_seconds_count 2.0\nvllm:e2e_request_latency_seconds_sum 1.5\n"
    )
    index = index_samples(text)
    _, kind = select_read_samples(text)
    assert kind is not None
    full = READERS[kind](index, None)
    assert read_engine(text) == full
    if kind is EngineKind.VLLM:
        assert read_engine(text + noise) == full


BASE = "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n"


@pytest.mark.parametrize(
    "text",
    [
        "sglang:num_running_reqs 1\nsglang:num_queue_reqs 1\nsglang:max_total_num_tokens NaN\n",
        "sglang:num_running_reqs 1\nsglang:num_queue_reqs 1\nsglang:max_total_num_tokens 1e300\n",
        BASE + 'vllm:cache_config_info{num_gpu_blocks="1e400",block_size="16"} 1\n',
        BASE + 'vllm:cache_config_info{num_gpu_blocks="99999999999999999999",block_size="16"} 1\n',
        BASE + "vllm:kv_cache_usage_perc 7\nvllm:prefix_cache_hits_total 9\n"
        "vllm:prefix_cache_queries_total 3\n",
        BASE + "vllm:kv_cache_usage_perc NaN\nvllm:prefix_cache_hits_total -Inf\n"
        "vllm:prefix_cache_queries_total 3\n",
    ],
)
def test_broken_values_are_absent_or_bounded_never_an_exception(text: str) -> None:
    r = read_engine(text)
    assert r.kv_capacity_tokens is None
    assert r.kv_usage is None or 0.0 <= r.kv_usage <= 1.0
    assert r.prefix_hit_rate is None or 0.0 <= r.prefix_hit_rate <= 1.0


def test_non_finite_or_negative_queue_gauges_count_as_missing() -> None:
    for waiting in ("NaN", "+Inf", "-1"):
        with pytest.raises(MetricsFormatError, match="missing"):
            read_engine(f"vllm:num_requests_running 1\nvllm:num_requests_waiting {waiting}\n")


def test_vllm_capacity_prefers_the_group_aware_label() -> None:
    # Every CacheConfig field vLLM 0.33 puts on cache_config_info (recorded from its wheel).
    from tests.kvevents.engine_fixtures import VLLM, load

    (info,) = [
        s for s in load(VLLM, "metrics.json")["series"] if s["name"] == "vllm:cache_config_info"
    ]
    assert "kv_cache_size_tokens" in info["labels"]
    values = {k: "None" for k in info["labels"]}
    values.update(num_gpu_blocks="1000", block_size="16", kv_cache_size_tokens="6000")

    def text(v: dict[str, str]) -> str:
        labels = ",".join(f'{k}="{x}"' for k, x in {**v, "engine": "0"}.items())
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0"} 0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0"} 0\n'
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{{{labels}}} 1.0\n"
        )

    reading = read_engine(text(values))
    assert reading is not None and reading.kv_capacity_tokens == 6000  # hybrid: not 16000
    reading = read_engine(text({**values, "kv_cache_size_tokens": "None"}))
    assert reading is not None and reading.kv_capacity_tokens == 16_000


def test_fast_reader_agrees_with_prometheus_client_on_the_text_format() -> None:
    # First line without a newline before it, escaped label values, a timestamp, a
    # carriage return and a label set with a trailing comma: read as prometheus-client does.
    text = (
        'vllm:num_requests_running{engine="0",model_name="a\\"b\\\\c"} 3 1700000000000\r\n'
        'vllm:num_requests_waiting{engine="0",} 2\n'
        "vllm:num_requests_waiting_other 9\n"
        'vllm:cache_config_info{num_gpu_blocks="10",block_size="16",note="x,y}z"} 1\n'
    )
    from gateway.scrape.adapters import select_read_samples

    fast, kind = select_read_samples(text)
    assert kind is EngineKind.VLLM
    full = index_samples(text)
    for name, series in fast.items():
        assert [(dict(labels), v) for labels, v in series] == [
            (dict(labels), v) for labels, v in full[name]
        ]
    assert set(fast) == {n for n in full if n != "vllm:num_requests_waiting_other"}
    assert read_engine(text).kv_capacity_tokens == 160


def test_a_malformed_label_set_of_a_read_series_is_unparseable() -> None:
    with pytest.raises(MetricsFormatError, match="unparseable"):
        read_engine('vllm:num_requests_running{engine="0" junk} 3\nvllm:num_requests_waiting 1\n')
