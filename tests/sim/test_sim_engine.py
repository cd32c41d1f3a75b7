"""EngineModel on a virtual clock: no HTTP, no event loop."""

from __future__ import annotations

import pytest

from gateway.sim.clock import VirtualClock
from gateway.sim.engine import EngineModel, RequestHandle, RequestRejected, SimRequest, State
from gateway.sim.profiles import PROFILES, HardwareProfile, get_profile

BS = 16


def small(**changes: object) -> HardwareProfile:
    base = get_profile("tiny").scaled(
        num_gpu_blocks=32, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512
    )
    return base.scaled(**changes)


def hashes(prefix: int, n_blocks: int) -> tuple[int, ...]:
    return tuple(prefix * 1000 + i for i in range(n_blocks))


def req(rid: str, tokens: int, prefix: int = 1, **kw: object) -> SimRequest:
    return SimRequest(rid, tokens, hashes(prefix, tokens // BS), **kw)  # type: ignore[arg-type]


def run(model: EngineModel, clock: VirtualClock, until: float = 1e9) -> None:
    while model.has_work and clock.now() < until:
        d = model.step(clock.now())
        clock.advance(d)


def test_repeated_prefix_is_cached_in_whole_blocks() -> None:
    m, clock = EngineModel(small()), VirtualClock()
    a = m.submit(req("a", 100, max_tokens=4), clock.now())
    run(m, clock)
    assert a.cached_tokens == 0 and a.finish_reason == "length" and a.output_tokens == 4
    b = m.submit(req("b", 100, max_tokens=4), clock.now())
    run(m, clock)
    assert b.cached_tokens == 96  # 6 whole blocks of 16
    assert m.stats.prefix_queries == 200 and m.stats.prefix_hits == 96
    # A fully cached prompt still recomputes its last token (so never hits 100%).
    c = m.submit(req("c", 96, max_tokens=1), clock.now())
    run(m, clock)
    assert c.cached_tokens == 80


def test_cached_prefix_makes_ttft_shorter() -> None:
    prof = small(prefill_tokens_per_s=1000.0)
    m, clock = EngineModel(prof), VirtualClock()
    a = m.submit(req("a", 200, max_tokens=1), clock.now())
    run(m, clock)
    b = m.submit(req("b", 200, max_tokens=1), clock.now())
    run(m, clock)
    assert a.first_token_time is not None and b.first_token_time is not None
    ttft_a = a.first_token_time - a.arrival
    ttft_b = b.first_token_time - b.arrival
    assert ttft_b < ttft_a / 5


def test_eviction_at_capacity_drops_least_recent_prefix() -> None:
    m, clock = EngineModel(small(num_gpu_blocks=16)), VirtualClock()
    for i, prefix in enumerate((1, 2, 3)):
        m.submit(req(f"r{i}", 96, prefix=prefix, max_tokens=1), clock.now())
        run(m, clock)
    # 3 prompts x 6 cached blocks > 16 blocks: the oldest prefix lost blocks.
    assert m.kv.evictions > 0
    old = m.submit(req("old", 96, prefix=1, max_tokens=1), clock.now())
    run(m, clock)
    new = m.submit(req("new", 96, prefix=3, max_tokens=1), clock.now())
    run(m, clock)
    assert (old.cached_tokens or 0) < (new.cached_tokens or 0) == 80


def test_requests_wait_when_blocks_run_out() -> None:
    m, clock = EngineModel(small(num_gpu_blocks=16)), VirtualClock()
    # Each needs 13 blocks for its prompt: only one fits at a time.
    hs = [
        m.submit(req(f"r{i}", 200, prefix=i, max_tokens=8, ignore_eos=True), 0.0) for i in range(3)
    ]
    m.step(clock.now())
    assert m.num_running == 1 and m.num_waiting == 2
    run(m, clock)
    assert all(h.finish_reason == "length" for h in hs)
    starts = [h.first_scheduled for h in hs]
    assert starts == sorted(starts) and starts[0] < starts[1] < starts[2]
    assert m.kv.blocks_in_use == 0


def test_newest_running_request_is_preempted_and_recomputed() -> None:
    # Both prompts fit (2 x 8 blocks of 16), but decoding needs more blocks than exist.
    m, clock = EngineModel(small(num_gpu_blocks=16)), VirtualClock()
    first = m.submit(req("first", 120, prefix=1, max_tokens=60, ignore_eos=True), 0.0)
    second = m.submit(req("second", 120, prefix=2, max_tokens=60, ignore_eos=True), 0.0)
    m.step(0.0)
    assert m.num_running == 2
    run(m, clock)
    assert first.num_preemptions == 0
    assert second.num_preemptions >= 1
    assert m.stats.preemptions == second.num_preemptions
    assert first.output_tokens == second.output_tokens == 60
    assert m.kv.blocks_in_use == 0


def test_priority_scheduling_orders_queue_and_picks_victim() -> None:
    m, clock = EngineModel(small(num_gpu_blocks=16), priority_scheduling=True), VirtualClock()
    blocker = m.submit(req("blocker", 200, prefix=9, max_tokens=4, ignore_eos=True), 0.0)
    m.step(0.0)
    low = m.submit(req("low", 200, prefix=1, max_tokens=2, priority=5), 0.0)
    high = m.submit(req("high", 200, prefix=2, max_tokens=2, priority=-1), 0.0)
    run(m, clock)
    assert blocker.finished
    assert high.first_scheduled is not None and low.first_scheduled is not None
    assert high.first_scheduled < low.first_scheduled


def test_priority_victim_is_lowest_priority_not_newest() -> None:
    m = EngineModel(small(num_gpu_blocks=16), priority_scheduling=True)
    clock = VirtualClock()
    low = m.submit(req("low", 120, prefix=1, max_tokens=60, ignore_eos=True, priority=9), 0.0)
    high = m.submit(req("high", 120, prefix=2, max_tokens=60, ignore_eos=True, priority=0), 0.0)
    run(m, clock)
    assert high.num_preemptions == 0 and low.num_preemptions >= 1


def test_higher_first_reverses_queue_order_and_victim() -> None:
    """SGLang's default: larger priority values are served first and preempted last."""
    m = EngineModel(small(num_gpu_blocks=16), priority_scheduling=True, higher_priority_first=True)
    clock = VirtualClock()
    blocker = m.submit(req("blocker", 200, prefix=9, max_tokens=4, ignore_eos=True), 0.0)
    m.step(0.0)
    low = m.submit(req("low", 200, prefix=1, max_tokens=2, priority=-1), 0.0)
    high = m.submit(req("high", 200, prefix=2, max_tokens=2, priority=5), 0.0)
    run(m, clock)
    assert blocker.finished
    assert high.first_scheduled is not None and low.first_scheduled is not None
    assert high.first_scheduled < low.first_scheduled
    m = EngineModel(small(num_gpu_blocks=16), priority_scheduling=True, higher_priority_first=True)
    low = m.submit(req("low", 120, prefix=1, max_tokens=60, ignore_eos=True, priority=0), 0.0)
    high = m.submit(req("high", 120, prefix=2, max_tokens=60, ignore_eos=True, priority=9), 0.0)
    run(m, clock)
    assert high.num_preemptions == 0 and low.num_preemptions >= 1


def test_abort_frees_blocks_everywhere() -> None:
    m = EngineModel(small(num_gpu_blocks=16))
    running = m.submit(req("a", 200, prefix=1, max_tokens=50), 0.0)
    waiting = m.submit(req("b", 200, prefix=2, max_tokens=50), 0.0)
    m.step(0.0)
    assert running.state is State.RUNNING and waiting.state is State.WAITING
    assert m.abort("b", 0.0)
    assert m.num_waiting == 0
    assert m.abort(running, 0.0)
    assert not m.abort(running, 0.0)
    assert m.kv.blocks_in_use == 0 and not m.has_work
    assert m.stats.finished["abort"] == 2
    assert running.finish_reason == "abort"


def test_chunked_prefill_respects_token_budget() -> None:
    m, clock = EngineModel(small(max_num_batched_tokens=64)), VirtualClock()
    h = m.submit(req("a", 200, max_tokens=1), 0.0)
    steps = 0
    while not h.finished:
        clock.advance(m.step(clock.now()))
        steps += 1
        assert h.num_computed <= 64 * steps
    assert steps == 4  # ceil(200 / 64)


def test_max_num_seqs_caps_the_batch() -> None:
    m = EngineModel(small(max_num_seqs=2, num_gpu_blocks=64))
    for i in range(4):
        m.submit(req(f"r{i}", 20, prefix=i, max_tokens=5), 0.0)
    m.step(0.0)
    assert m.num_running == 2 and m.num_waiting == 2


def test_decode_step_grows_with_batch_and_dense_context() -> None:
    dense = get_profile("h200-dense")
    sparse = get_profile("h200-sparse")
    assert dense.step_time(0, 64, 0) > dense.step_time(0, 1, 0)
    ctx = 100_000
    assert dense.step_time(0, 8, 8 * dense.attended(ctx)) > sparse.step_time(
        0, 8, 8 * sparse.attended(ctx)
    )
    assert get_profile("domestic").prefill_tokens_per_s < dense.prefill_tokens_per_s


def test_too_long_prompt_is_rejected() -> None:
    m = EngineModel(small())
    with pytest.raises(RequestRejected, match="maximum context length"):
        m.submit(req("a", 600), 0.0)
    with pytest.raises(RequestRejected):
        m.submit(req("b", 400, max_tokens=200), 0.0)


def test_natural_length_is_deterministic_and_stops() -> None:
    def lengths(seed: int) -> list[tuple[int, str | None]]:
        m, clock = EngineModel(small(), seed=seed), VirtualClock()
        hs = [m.submit(req(f"r{i}", 20, prefix=i, output_seed=i), 0.0) for i in range(5)]
        run(m, clock)
        return [(h.output_tokens, h.finish_reason) for h in hs]

    assert lengths(1) == lengths(1)
    assert lengths(1) != lengths(2)
    assert {r for _, r in lengths(1)} == {"stop"}


def test_token_times_follow_steps_on_the_virtual_clock() -> None:
    prof = small()
    m, clock = EngineModel(prof), VirtualClock()
    h = m.submit(req("a", 32, max_tokens=5, ignore_eos=True), 0.0)
    run(m, clock)
    assert len(h.token_times) == 5
    gaps = [b - a for a, b in zip(h.token_times, h.token_times[1:])]
    # tiny has no attention term, so every decode step costs the same.
    assert gaps == pytest.approx([prof.step_time(0, 1, 0)] * 4)
    assert h.first_token_time == pytest.approx(prof.step_time(32, 0, 0))
    assert h.finish_time == h.token_times[-1] == pytest.approx(clock.now())


def test_remote_kv_skips_prefill_and_costs_transfer_time() -> None:
    prof = small(prefill_tokens_per_s=1000.0, link_bytes_per_s=1024 * 10000.0)
    m, clock = EngineModel(prof), VirtualClock()
    h = m.submit(req("d", 201, remote_kv=True, max_tokens=3, ignore_eos=True), 0.0)
    d = m.step(0.0)
    assert h.state is State.WAITING_REMOTE_KV
    assert d == pytest.approx(prof.transfer_time(200))
    run(m, clock)
    assert h.output_tokens == 3
    assert h.transfer_bytes == 200 * prof.kv_bytes_per_token == m.stats.kv_rx_bytes
    assert h.cached_tokens == 200
    # TTFT = transfer + one tiny step, far less than prefilling 200 tokens at 1000 tok/s.
    assert h.first_token_time is not None and h.first_token_time < 200 / 1000.0


def test_hold_kv_keeps_blocks_until_released_or_expired() -> None:
    m, clock = EngineModel(small(), kv_hold_timeout_s=5.0), VirtualClock()
    h = m.submit(req("p", 64, hold_kv=True, max_tokens=1), 0.0)
    run(m, clock)
    assert h.finished and m.is_held("p") and m.kv.blocks_in_use == len(h.held_blocks) == 4
    released = m.release_held("p")
    assert released == (64, h.held_blocks)
    assert m.kv.blocks_in_use == 0 and m.stats.kv_tx_bytes == 64 * small().kv_bytes_per_token
    assert m.release_held("p") is None
    m.submit(req("q", 64, prefix=2, hold_kv=True, max_tokens=1), clock.now())
    run(m, clock)
    assert m.is_held("q")
    m.step(clock.now() + 10.0)
    assert not m.is_held("q") and m.kv.blocks_in_use == 0


def test_text_submission_uses_tokenizer_and_chained_hashes() -> None:
    m, clock = EngineModel(small()), VirtualClock()
    base = "x" * 400
    a = m.submit_text("a", base, 0.0, max_tokens=1)
    run(m, clock)
    b = m.submit_text("b", base + " and a new question", clock.now(), max_tokens=1)
    salted = m.submit_text("c", base, clock.now(), cache_salt="tenant-2", max_tokens=1)
    run(m, clock)
    assert a.prompt_tokens == 100 and a.cached_tokens == 0
    assert b.cached_tokens == 96
    assert salted.cached_tokens == 0


def test_instant_profile_runs_to_completion_in_one_call() -> None:
    m = EngineModel(PROFILES["instant"])
    h: RequestHandle = m.submit(req("a", 50, max_tokens=7, ignore_eos=True), 0.0)
    m.run_to_completion(h, 0.0)
    assert h.output_tokens == 7 and h.finish_time == pytest.approx(0.0, abs=1e-6)


def test_long_prefill_threshold_caps_each_requests_chunk() -> None:
    # One long prompt, then a short one while the long one is mid-prefill.
    def first_token_of_short(threshold: int) -> tuple[float, list[int]]:
        prof = small(
            max_num_batched_tokens=128,
            prefill_tokens_per_s=1000.0,
            long_prefill_token_threshold=threshold,
        )
        m, clock = EngineModel(prof), VirtualClock()
        long = m.submit(req("long", 480, prefix=1, max_tokens=1), clock.now())
        clock.advance(m.step(clock.now()))
        short = m.submit(req("short", 32, prefix=2, max_tokens=1), clock.now())
        chunks = []
        while not short.finished:
            before = long.num_computed
            clock.advance(m.step(clock.now()))
            chunks.append(long.num_computed - before)
        run(m, clock)
        assert long.finished and long.output_tokens == 1
        assert short.first_token_time is not None
        return short.first_token_time - short.arrival, chunks

    uncapped, uncapped_chunks = first_token_of_short(0)
    capped, capped_chunks = first_token_of_short(64)
    # Uncapped, the long prefill takes the whole budget until it is done; capped, it takes
    # 64 tokens a step and the short prompt is prefilled beside it at once.
    assert uncapped_chunks[:3] == [128, 128, 96]
    assert capped_chunks == [64]
    assert capped < uncapped / 3
    # A prompt under the threshold is not split further than the budget splits it.
    m = EngineModel(small(long_prefill_token_threshold=64))
    h = m.submit(req("a", 40, max_tokens=1), 0.0)
    m.step(0.0)
    assert h.finished
