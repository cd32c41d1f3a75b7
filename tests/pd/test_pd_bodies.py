from __future__ import annotations

import random

from gateway.pd import sglang, vllm


def test_vllm_prefill_leg_asks_for_remote_decode() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 3,
        "temperature": 0.2,
    }
    leg = vllm.prefill_body(body)
    assert leg["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert leg["stream"] is False and leg["max_tokens"] == 1
    assert leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["temperature"] == 0.2 and leg["messages"] == body["messages"]
    assert body["stream"] is True and "kv_transfer_params" not in body  # original untouched
    assert "max_completion_tokens" not in vllm.prefill_body({"model": "m"})


def test_vllm_decode_leg_relays_params_verbatim() -> None:
    returned = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2],
        "remote_engine_id": "e",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "some_future_field": {"tp": 2},
    }
    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 50, "min_tokens": 3}
    params = vllm.kv_params_from({"id": "c", "kv_transfer_params": returned})
    assert params == returned
    leg = vllm.decode_body(body, params)
    assert leg["kv_transfer_params"] == returned
    assert {k: v for k, v in leg.items() if k != "kv_transfer_params"} == body
    assert vllm.kv_params_from({"id": "c"}) is None
    assert vllm.kv_params_from({"kv_transfer_params": {}}) is None
    assert vllm.kv_params_from([1]) is None


def test_sglang_bootstrap_fields() -> None:
    rng = random.Random(7)
    rooms = {sglang.new_room(rng) for _ in range(200)}
    assert len(rooms) == 200
    assert all(0 <= r <= 2**63 - 1 for r in rooms)
    body = {"model": "m", "prompt": "x", "stream": True}
    leg = sglang.with_bootstrap(body, "10.1.2.3", 8998, 42)
    assert leg == {
        **body,
        "bootstrap_host": "10.1.2.3",
        "bootstrap_port": 8998,
        "bootstrap_room": 42,
    }
    assert sglang.bootstrap_host("http://10.1.2.3:8000") == "10.1.2.3"
    assert sglang.bootstrap_host("http://[::1]:8000/v1") == "::1"
