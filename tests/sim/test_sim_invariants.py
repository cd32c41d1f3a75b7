"""The engine model's books after driven workloads (gateway.sim.engine, gateway.sim.kvcache):
KV accounting (every block owned or free, reference counts equal to holders, the cache map
true to the blocks), eviction, preemption and the KV event stream checked after every step
of seeded random workloads; and the prefill/decode timing model (TTFT grows with uncached
tokens, prefix hits cut it, decode grows with dense context)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored
from gateway.sim.clock import VirtualClock
from gateway.sim.engine import EngineModel, RequestHandle, SimRequest, State
from gateway.sim.kvcache import KVCache
from gateway.sim.profiles import PROFILES, HardwareProfile, get_profile
from gateway.sim.tokenizer import ApproxTokenizer, chain_block_hashes

BS = 16


def profile(**changes: object) -> HardwareProfile:
    return (
        get_profile("tiny")
        .scaled(num_gpu_blocks=48, max_num_seqs=6, max_num_batched_tokens=192, max_model_len=512)
        .scaled(**changes)
    )


def check_books(model: EngineModel, handles: list[RequestHandle]) -> None:
    """Every invariant the cache and the scheduler keep between steps."""
    kv = model.kv
    blocks = kv._blocks
    free = set(kv._free)
    holders: Counter[int] = Counter()
    for owner in kv.owners():
        held = kv.blocks_of(owner)
        assert len(held) == len(set(held)), f"{owner} holds a block twice"
        holders.update(held)
    for block in blocks:
        # A block is free exactly when nobody holds it, and its count is its holders'.
        assert (block.block_id in free) == (block.ref_cnt == 0), block
        assert block.ref_cnt == holders[block.block_id], block
    assert kv.blocks_in_use == len(holders) == kv.num_blocks - len(free)
    assert 0.0 <= kv.usage <= 1.0
    for h, block_id in kv._cached.items():
        assert blocks[block_id].block_hash == h  # the map is true to the blocks
    hashed = [b for b in blocks if b.block_hash is not None]
    assert len(hashed) == kv.num_cached_blocks
    running = [h for h in handles if h.state is State.RUNNING]
    assert len(running) == model.num_running <= model.profile.max_num_seqs
    for h in handles:
        held = len(kv.blocks_of(h.owner))
        if h.state is State.RUNNING:
            assert held >= kv.blocks_needed(h.num_computed)
            assert h.num_computed <= h.num_tokens
        elif h.state is State.WAITING:
            assert h.num_computed == 0 or held > 0
        elif h.finished and not model.is_held(h.request_id):
            assert held == 0, h.request_id
    stats = model.stats
    assert stats.prefix_hits <= stats.prefix_queries
    assert stats.generation_tokens == sum(h.output_tokens for h in handles)


def mirror(events: list[object], seen: set[int]) -> None:
    """What an indexer following the KV events believes is cached."""
    for event in events:
        if isinstance(event, BlockStored):
            seen.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert h in seen, "a block removed that was never stored"
                seen.discard(h)
        elif isinstance(event, AllBlocksCleared):
            seen.clear()


def workload(rng: random.Random, n: int) -> list[tuple[float, str]]:
    """(arrival, text) pairs: a few shared openings, varied tails, bursts."""
    openings = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(64, 600))) for _ in "xyz"]
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(400.0)
        tail = "".join(rng.choice("ijklmnop") for _ in range(rng.randint(1, 500)))
        out.append((t, rng.choice(openings) + tail))
    return out


@pytest.mark.parametrize(
    ("seed", "changes"),
    [
        (1, {}),
        (2, {"long_prefill_token_threshold": 48}),
        (3, {"num_gpu_blocks": 40, "max_num_seqs": 8}),
    ],
)
def test_books_balance_after_every_step_of_a_random_workload(
    seed: int, changes: dict[str, object]
) -> None:
    rng = random.Random(seed)
    model = EngineModel(profile(**changes), seed=seed)
    model.kv.events = []
    clock = VirtualClock()
    pending = workload(rng, 40)
    handles: list[RequestHandle] = []
    seen: set[int] = set()
    steps = 0
    while pending or model.has_work:
        while pending and pending[0][0] <= clock.now():
            _, text = pending.pop(0)
            handles.append(
                model.submit_text(
                    f"r{len(handles)}", text, clock.now(), max_tokens=rng.randint(1, 40)
                )
            )
        if model.has_work:
            duration = model.step(clock.now())
            assert duration > 0
            clock.advance(duration)
        else:
            clock.advance_to(pending[0][0])
        if rng.random() < 0.05 and handles:
            model.abort(rng.choice(handles), clock.now())
        check_books(model, handles)
        mirror(model.take_kv_events(), seen)
        assert seen == set(model.kv._cached), "the event stream drifted from the cache"
        steps += 1
    assert all(h.finished for h in handles)
    assert model.kv.blocks_in_use == 0 and model.num_waiting == 0
    assert model.stats.preemptions > 0 and model.kv.evictions > 0  # the pressure was real
    assert sum(model.stats.finished.values()) == len(handles)
    assert sum(h.num_preemptions for h in handles) == model.stats.preemptions
    for h in handles:
        assert h.token_times == sorted(h.token_times)
        if h.first_token_time is not None:
            assert h.arrival <= (h.first_scheduled or 0) < h.first_token_time
        if h.finish_reason == "abort":
            assert h.output_tokens < h.target_tokens
        else:
            assert h.finish_reason in ("stop", "length")
            assert h.finish_time == h.token_times[-1]
            assert h.output_tokens == h.target_tokens


def test_priority_workload_keeps_the_books_and_serves_urgent_requests_first() -> None:
    model = EngineModel(profile(num_gpu_blocks=24), priority_scheduling=True)
    rng = random.Random(7)
    handles = [
        model.submit(
            SimRequest(f"r{i}", rng.randint(40, 150), (), max_tokens=30, priority=i % 3),
            0.0,
        )
        for i in range(18)
    ]
    clock = VirtualClock()
    while model.has_work:
        clock.advance(model.step(clock.now()))
        check_books(model, handles)
    by_priority: dict[int, list[float]] = {}
    for h in handles:
        assert h.first_token_time is not None
        by_priority.setdefault(h.request.priority, []).append(h.first_token_time)
    # Lower values run first (vLLM): the median urgent request starts before the others.
    medians = {p: sorted(ts)[len(ts) // 2] for p, ts in by_priority.items()}
    assert medians[0] < medians[1] < medians[2]


def test_pd_legs_keep_the_books_while_held_and_after_release() -> None:
    model = EngineModel(profile(), kv_hold_timeout_s=5.0)
    clock = VirtualClock()
    prefill = model.submit(SimRequest("p", 100, (), max_tokens=1, hold_kv=True), 0.0)
    decode = model.submit(SimRequest("d", 100, (), max_tokens=3, remote_kv=True), 0.0)
    handles = [prefill, decode]
    while model.has_work:
        clock.advance(model.step(clock.now()))
        check_books(model, handles)
    assert prefill.finished and model.is_held("p")
    assert len(model.kv.blocks_of(prefill.owner)) == 7  # held after finishing
    assert decode.cached_tokens == 99 and decode.transfer_bytes == 99 * 1024
    assert model.stats.kv_rx_bytes == 99 * 1024
    released = model.release_held("p")
    assert released is not None and released[0] == 100 and len(released[1]) == 7
    assert model.release_held("p") is None  # once only
    assert model.stats.kv_tx_bytes == 100 * 1024
    assert model.kv.blocks_in_use == 0
    check_books(model, handles)


def test_a_held_leg_nobody_fetches_is_freed_at_its_timeout() -> None:
    model = EngineModel(profile(), kv_hold_timeout_s=2.0)
    handle = model.submit(SimRequest("p", 64, (), max_tokens=1, hold_kv=True), 0.0)
    clock = VirtualClock()
    while model.has_work:
        clock.advance(model.step(clock.now()))
    assert model.num_held == 1 and model.kv.blocks_in_use == 4
    model.step(clock.now() + 1.0)
    assert model.num_held == 1
    model.step(clock.now() + 2.5)
    assert model.num_held == 0 and model.kv.blocks_in_use == 0
    check_books(model, [handle])


def test_an_aborted_transfer_and_an_aborted_waiting_request_free_everything() -> None:
    model = EngineModel(profile(link_bytes_per_s=1e3))  # a very slow link
    moving = model.submit(SimRequest("m", 100, (), max_tokens=2, remote_kv=True), 0.0)
    model.step(0.0)
    assert moving.state is State.WAITING_REMOTE_KV and model.num_waiting == 1
    # Only a transfer pending: the step says how long until it lands.
    assert model.step(0.0) == pytest.approx(99 * 1024 / 1e3)
    assert model.abort("m", 0.1) and not model.abort("m", 0.2)
    assert model.kv.blocks_in_use == 0 and model.num_waiting == 0
    queued = [model.submit(SimRequest(f"q{i}", 400, (), max_tokens=100), 0.0) for i in range(3)]
    model.step(0.0)
    waiting = [h for h in queued if h.state is State.WAITING]
    assert waiting and model.abort(waiting[-1], 0.0)
    check_books(model, [moving, *queued])
    assert model.stats.finished["abort"] == 2


# ---- the KV cache alone ---------------------------------------------------------------------


def test_the_cache_refuses_bad_sizes_and_reports_events_only_when_asked() -> None:
    with pytest.raises(ValueError):
        KVCache(0)
    with pytest.raises(ValueError):
        KVCache(4, block_size=0)
    kv = KVCache(4, block_size=2)
    assert kv.allocate("a", 4) and kv.blocks_of("a") == [0, 1]
    kv.cache_full_blocks("a", (11, 12), 2, token_ids=(1, 2, 3, 4))
    kv.cache_full_blocks("nobody", (11,), 1)  # an owner that holds nothing: no change
    assert kv.events is None and kv.num_cached_blocks == 2
    kv.events = []
    assert kv.free("a") == 2 and kv.free("a") == 0
    assert kv.allocate("b", 8)  # takes every block: both cached ones are evicted
    assert kv.evictions == 2 and kv.num_cached_blocks == 0
    # One event for the run; the end of a prompt was freed (so evicted) first.
    assert kv.events == [BlockRemoved((12, 11), "GPU")]


def test_stored_events_carry_runs_their_parent_and_their_tokens() -> None:
    kv = KVCache(8, block_size=2)
    kv.events = []
    ids = tuple(range(100, 108))
    assert kv.allocate("a", 8)
    kv.cache_full_blocks("a", (1, 2, 3, 4), 2, ids)
    kv.cache_full_blocks("a", (1, 2, 3, 4), 4, ids)
    first, second = kv.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == (1, 2) and first.parent_block_hash is None
    assert first.token_ids == (100, 101, 102, 103)
    assert second.block_hashes == (3, 4) and second.parent_block_hash == 2
    # Another owner with the same content registers nothing new: no event.
    assert kv.allocate("b", 4)
    kv.cache_full_blocks("b", (1, 2), 2, ids)
    assert len(kv.events) == 2
    kv.drop_cached()
    assert isinstance(kv.events[-1], AllBlocksCleared) and kv.num_cached_blocks == 0
    assert not kv.reset_prefix_cache()  # blocks still held


# ---- the timing model -----------------------------------------------------------------------


def ttft(model: EngineModel, clock: VirtualClock, text: str) -> tuple[float, int]:
    start = clock.now()
    handle = model.submit_text(f"t{start}", text, start, max_tokens=1)
    while model.has_work:
        clock.advance(model.step(clock.now()))
    assert handle.first_token_time is not None
    return handle.first_token_time - start, handle.cached_tokens or 0


def test_ttft_grows_with_uncached_tokens_and_prefix_hits_cut_it() -> None:
    prof = PROFILES["h200-dense"].scaled(max_num_batched_tokens=100_000)
    model, clock = EngineModel(prof), VirtualClock()
    times = [ttft(model, clock, chr(97 + i) * n)[0] for i, n in enumerate((400, 4000, 40000))]
    assert times[0] < times[1] < times[2]
    # The model's own cost: overhead + prefill tokens / rate (one step, no decode).
    assert times[2] == pytest.approx(prof.step_overhead_s + 10_000 / prof.prefill_tokens_per_s)
    opening = "z" * 32_000
    cold, cached = ttft(model, clock, opening + " first question")
    assert cached == 0
    warm, cached = ttft(model, clock, opening + " second question, longer")
    assert cached == 8000 // BS * BS
    assert warm < cold / 10  # only the uncached tail is prefilled


def test_dense_decode_reads_the_context_and_sparse_caps_it() -> None:
    dense = get_profile("h200-dense")
    sparse = get_profile("h200-sparse")
    assert dense.attended(10_000) == 10_000 and sparse.attended(10_000) == 2048
    short, long = dense.step_time(0, 1, 100), dense.step_time(0, 1, 100_000)
    assert long - short == pytest.approx(dense.attention_s_per_token * 99_900)
    assert dense.step_time(0, 0, 100_000) == dense.step_overhead_s  # no decode, no attention
    assert dense.transfer_time(1000) == pytest.approx(1000 * 327_680 / 50e9)
    # A batch's decode step costs more per added sequence.
    assert dense.step_time(0, 8, 800) > dense.step_time(0, 1, 100)


def test_profiles_are_data_and_unknown_names_list_the_known() -> None:
    tiny = get_profile("tiny")
    assert tiny.kv_capacity_tokens == 64 * 16
    bigger = tiny.scaled(num_gpu_blocks=128)
    assert bigger.kv_capacity_tokens == 2 * tiny.kv_capacity_tokens and tiny.num_gpu_blocks == 64
    with pytest.raises(ValueError, match="known profiles: domestic, h200-dense"):
        get_profile("h100")
    with pytest.raises(AttributeError):
        tiny.num_gpu_blocks = 1  # type: ignore[misc]


def test_text_prompts_hash_the_same_blocks_the_tokenizer_cuts() -> None:
    model = EngineModel(profile())
    text = "0123456789abcdef" * 20  # 80 tokens: 5 whole blocks
    tokens, hashes = model.prompt_from_text(text)
    payloads = ApproxTokenizer().encode(text, BS).block_payloads
    assert tokens == 80 and hashes == chain_block_hashes(payloads)
    salted = model.prompt_from_text(text, cache_salt="tenant-a")[1]
    assert salted != hashes and len(salted) == 5
    assert model.token_ids(text) == ()  # no KV events: no ids carried
    model.kv.events = []
    assert len(model.token_ids(text)) == 80
