"""The engine-side half of priority classes: the simulated engine's priority scheduling, as
vLLM V1 does it with `--scheduling-policy priority`, and where it stops helping.

Admission maps classes onto vLLM's `priority`; these tests pin the engine behaviour the
gateway relies on (and must not expect more of): the waiting queue is ordered by
(priority, arrival), but running requests keep the step budget, so a better waiting
request is not scheduled ahead of lower-priority prefills already running.
"""

from __future__ import annotations

from gateway.sim.clock import VirtualClock
from gateway.sim.engine import EngineModel, SimRequest, State
from gateway.sim.profiles import HardwareProfile, get_profile

BS = 16


def _profile(**changes: object) -> HardwareProfile:
    base = get_profile("tiny").scaled(
        num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024
    )
    return base.scaled(**changes)


def _req(rid: str, tokens: int, prefix: int, priority: int, max_tokens: int = 8) -> SimRequest:
    hashes = tuple(prefix * 1000 + i for i in range(tokens // BS))
    return SimRequest(
        rid, tokens, hashes, max_tokens=max_tokens, ignore_eos=True, priority=priority
    )


def test_running_low_priority_prefills_keep_the_budget() -> None:
    # Two long low-priority prompts, each chunked to 32 tokens a step, fill the 64-token
    # step budget; a high-priority request arriving after them waits for one to finish its
    # prefill, priority scheduling or not (vLLM schedules running requests first).
    m = EngineModel(
        _profile(max_num_batched_tokens=64, long_prefill_token_threshold=32),
        priority_scheduling=True,
    )
    clock = VirtualClock()
    lows = [m.submit(_req(f"low{i}", 320, prefix=i + 1, priority=9), 0.0) for i in range(2)]
    clock.advance(m.step(clock.now()))
    high = m.submit(_req("high", 16, prefix=7, priority=0), clock.now())
    for _ in range(8):
        clock.advance(m.step(clock.now()))
    assert high.first_scheduled is None and high.state is State.WAITING
    while high.first_token_time is None:
        clock.advance(m.step(clock.now()))
    # It got its first tokens only once a low prompt's prefill was over.
    first_low_token = min(low.token_times[0] for low in lows if low.token_times)
    assert high.first_scheduled is not None and high.first_scheduled >= first_low_token


def test_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    m = EngineModel(_profile(max_num_seqs=1), priority_scheduling=True)
    clock = VirtualClock()
    blocker = m.submit(_req("blocker", 32, prefix=1, priority=0, max_tokens=4), 0.0)
    clock.advance(m.step(clock.now()))
    late_low = m.submit(_req("a-low", 32, prefix=2, priority=2), clock.now())
    early_mid = m.submit(_req("b-mid", 32, prefix=3, priority=1), clock.now())
    later_mid = m.submit(_req("c-mid", 32, prefix=4, priority=1), clock.now())
    while m.has_work:
        clock.advance(m.step(clock.now()))
    handles = (late_low, early_mid, later_mid)
    order = sorted((h.first_scheduled or 0.0, h.request_id) for h in handles)
    assert blocker.finished
    assert [rid for _, rid in order] == ["b-mid", "c-mid", "a-low"]


def test_a_request_that_is_its_own_victim_ends_the_running_pass() -> None:
    # KV is full. Running, in order: x (priority 0), a (priority 5), b (priority 1). a's
    # next token needs a new block; the lowest-priority running request is a itself, so
    # vLLM preempts it and schedules no further running request in that step: b waits one
    # step even though it needs no new block.
    m = EngineModel(_profile(num_gpu_blocks=6), priority_scheduling=True)
    x = m.submit(_req("x", 20, prefix=1, priority=0), 0.0)
    a = m.submit(_req("a", 31, prefix=2, priority=5), 0.0)
    m.step(0.0)
    b = m.submit(_req("b", 20, prefix=3, priority=1), 1.0)
    m.step(1.0)
    assert [h.request_id for h in m.iter_running()] == ["x", "a", "b"]
    assert (x.output_tokens, a.output_tokens, b.output_tokens) == (2, 2, 1)
    assert m.kv.blocks_in_use == 6
    assert m.step(2.0) > 0
    assert a.num_preemptions == 1 and a.state is State.WAITING
    assert (x.output_tokens, b.output_tokens) == (3, 1)
    m.step(3.0)
    assert b.output_tokens == 2
    now = 4.0
    while m.has_work:
        now += m.step(now)
    assert a.finished and a.output_tokens == 8 and x.finished and b.finished
