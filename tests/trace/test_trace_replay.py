"""Replay against real simulated engines over HTTP (uvicorn on loopback)."""

from __future__ import annotations

import io

import pytest

from gateway.sim.cluster import SimCluster
from gateway.trace.format import Trace, TraceHeader, TraceRecord
from gateway.trace.replay import PromptBuilder, replay
from gateway.trace.tokenize import ApproxTokenizer

BT = 64


def rec(t: float, hashes: tuple[int, ...], out: int = 4, last: int = BT) -> TraceRecord:
    return TraceRecord(t, (len(hashes) - 1) * BT + last, out, hashes, last)


A8 = tuple(range(100, 108))
TRACE = Trace(
    TraceHeader(block_tokens=BT),
    (
        rec(0.0, A8),  # 512 tokens
        rec(0.1, A8 + (200, 201, 202, 203)),  # shares 512 tokens with the first
        rec(0.2, (300, 301, 302, 303, 304, 305), last=40),  # unrelated, partial last block
        rec(0.3, A8 + (200, 201, 202, 203)),  # the second again: all but the last token
    ),
)


def test_prompt_text_has_trace_length_and_shares_prefixes() -> None:
    builder = PromptBuilder(BT)
    tok = ApproxTokenizer()
    texts = [builder.prompt(r, i) for i, r in enumerate(TRACE.records)]
    assert [tok.count(t) for t in texts] == [r.input_tokens for r in TRACE.records]
    assert texts[1].startswith(texts[0]) and texts[3] == texts[1]
    assert texts[2][:40] != texts[0][:40]
    # Equal hash, equal text, even from another builder.
    assert PromptBuilder(BT).prompt(TRACE.records[0], 9) == texts[0]
    no_hashes = TraceRecord(0.0, 30, 1)
    assert tok.count(builder.prompt(no_hashes, 0)) == 30
    assert builder.prompt(no_hashes, 0) != builder.prompt(no_hashes, 1)


async def test_replay_reproduces_cache_hits() -> None:
    async with SimCluster(1, time_scale=20.0) as cluster:
        report = await replay(TRACE, cluster.urls[0], concurrency=1, endpoint="completions")
    assert report.errors == 0, report.error_kinds
    cached = [r.cached_tokens for r in report.results]
    # Engine blocks are 16 tokens; a prompt's last token is never served from cache.
    assert cached == [0, 512, 0, 752]
    assert [r.prompt_tokens for r in report.results] == [r.input_tokens for r in TRACE.records]
    assert [r.output_tokens for r in report.results] == [4, 4, 4, 4]
    assert report.hit_rate == pytest.approx((512 + 752) / (512 + 768 + 360 + 768))


async def test_replay_chat_open_loop_report_and_progress() -> None:
    out = io.StringIO()
    async with SimCluster(1, time_scale=20.0) as cluster:
        report = await replay(TRACE, cluster.urls[0] + "/v1", speedup=4.0, progress=out)
    assert report.ok == 4 and report.errors == 0
    r = report.results
    # The chat template and the short system message add a few tokens to the trace's prompt.
    assert all(0 < x.prompt_tokens - t.input_tokens <= 20 for x, t in zip(r, TRACE.records))
    assert r[1].cached_tokens is not None and r[1].cached_tokens >= 512 - 16
    assert all(x.ttft_s is not None and x.ttft_s > 0 for x in r)
    assert all(len(x.itl_s) == 3 for x in r)
    assert r[3].start_s >= 0.3 / 4.0 - 0.01  # arrivals compressed 4x
    assert report.total_tokens_per_s > report.output_tokens_per_s > 0
    assert "4/4 done" in out.getvalue()
    assert "TTFT" in report.render()


async def test_replay_counts_errors_and_never_drops_a_request() -> None:
    async with SimCluster(1, time_scale=20.0) as cluster:
        url = cluster.urls[0]
        wrong_model = await replay(TRACE, url, concurrency=2, model="no-such-model")
    assert wrong_model.requests == 4 and wrong_model.errors == 4
    assert set(wrong_model.error_kinds) == {"http_404"}
    # Nothing listens there any more.
    refused = await replay(TRACE, url, concurrency=4, timeout_s=5.0)
    assert refused.errors == 4 and set(refused.error_kinds) == {"transport_error"}
    assert refused.hit_rate is None


async def test_replay_through_the_gateway_keeps_sessions_on_their_cache() -> None:
    from gateway.testing.servers import gateway, sim_engines

    def turn(t: float, n: int, session: str, base: int) -> TraceRecord:
        return TraceRecord(t, n * BT, 3, tuple(range(base, base + n)), BT, session)

    # Two conversations, three turns each, interleaved; each turn extends the last by 256.
    recs = [
        turn(0.05 * (2 * k + c), 8 + 4 * k, f"s{c}", 1000 * (c + 1))
        for k in range(3)
        for c in (0, 1)
    ]
    trace = Trace(TraceHeader(block_tokens=BT), tuple(recs))
    async with sim_engines(3, "h200-sparse", time_scale=20.0) as engines, gateway(engines) as gw:
        report = await replay(trace, gw.url, concurrency=1, endpoint="completions")
    assert report.errors == 0, report.error_kinds
    # The session id travels as X-Session-Id, so later turns find their prefix.
    assert [r.cached_tokens for r in report.results] == [0, 0, 512, 512, 768, 768]


async def test_several_urls_take_turns_like_a_client_side_balancer() -> None:
    # Two engines, no router: request i goes to engine i mod 2, so the second request
    # finds nothing of the first (it went to the other engine) and the fourth finds the
    # second's prefix (they both went to engine 1).
    async with SimCluster(2, time_scale=20.0) as cluster:
        report = await replay(TRACE, cluster.urls, concurrency=1, endpoint="completions")
    assert report.errors == 0, report.error_kinds
    assert [r.cached_tokens for r in report.results] == [0, 0, 0, 752]
    with pytest.raises(ValueError, match="no base URL"):
        await replay(TRACE, [], concurrency=1)
