"""`auto` end to end: the gateway splits only long uncached prompts, and counts why."""

from __future__ import annotations

from typing import Any

from gateway.types import Role

B, P, D = Role.BOTH, Role.PREFILL, Role.DECODE
SESSION = {"X-Session-Id": "conversation-1"}


def _text(tokens: int, seed: str) -> str:
    """About `tokens` tokens (4 characters each) of text unique to `seed`."""
    out = " ".join(f"{seed}{i}" for i in range(tokens))
    return out[: tokens * 4]


async def test_auto_splits_only_where_it_pays(rig_factory: Any) -> None:
    async with rig_factory([B, P, D], mode="auto", min_uncached_tokens=1024) as rig:

        def decided(reason: str, how: str) -> float:
            return float(
                rig.metric(
                    "kvgate_pd_decisions_total", model="kvgate-sim", decision=how, reason=reason
                )
            )

        # Shorter than one block: nothing to move.
        resp = await rig.chat("hello there", headers={"X-Session-Id": "c0"})
        assert resp.headers["x-kvgate-replica"] == "c0"
        assert decided("prompt_under_one_block", "colocated") == 1

        # An 800-token opening turn: under the threshold, served (and cached) on c0.
        turn1 = [{"role": "user", "content": _text(800, "a")}]
        resp = await rig.http.post(
            "/v1/chat/completions",
            headers=SESSION,
            json={"model": "kvgate-sim", "messages": turn1, "max_tokens": 4},
        )
        assert resp.headers["x-kvgate-replica"] == "c0"
        assert decided("uncached_below_threshold", "colocated") == 1
        answer = resp.json()["choices"][0]["message"]["content"]

        # The next turn is ~1400 tokens, but ~800 of them are cached on c0: colocated.
        turn2 = turn1 + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": _text(600, "b")},
        ]
        resp = await rig.http.post(
            "/v1/chat/completions",
            headers=SESSION,
            json={"model": "kvgate-sim", "messages": turn2, "max_tokens": 4},
        )
        assert resp.headers["x-kvgate-replica"] == "c0"
        assert decided("uncached_below_threshold", "colocated") == 2

        # A fresh 1500-token conversation has nothing cached anywhere: split.
        resp = await rig.http.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": "c2"},
            json={
                "model": "kvgate-sim",
                "messages": [{"role": "user", "content": _text(1500, "c")}],
                "max_tokens": 4,
            },
        )
        assert resp.headers["x-kvgate-replica"] == "d0"
        assert decided("uncached_long_transfer_cheap", "disaggregate") == 1
        await rig.settle()


async def test_auto_keeps_huge_kv_colocated(rig_factory: Any) -> None:
    # 2000 tokens x 320 KiB over 1 Gbit/s is seconds: never worth moving.
    async with rig_factory([B, P, D], mode="auto", link_gbps=1) as rig:
        resp = await rig.chat()
        assert resp.headers["x-kvgate-replica"] == "c0"
        assert (
            rig.metric(
                "kvgate_pd_decisions_total",
                model="kvgate-sim",
                decision="colocated",
                reason="transfer_over_budget",
            )
            == 1
        )
        assert rig.records("p0") == [] and rig.records("d0") == []
        await rig.settle()


async def test_unsupported_body_and_never_mode_pass_through(rig_factory: Any) -> None:
    async with rig_factory([B, P, D], mode="always") as rig:
        resp = await rig.chat(n=2)
        assert resp.headers["x-kvgate-replica"] == "c0"
        assert (
            rig.metric(
                "kvgate_pd_decisions_total",
                model="kvgate-sim",
                decision="colocated",
                reason="unsupported_request",
            )
            == 1
        )
    async with rig_factory([B, P, D], mode="never") as rig:
        assert rig.state.dispatcher is None  # nothing built for PD
        resp = await rig.chat()
        assert resp.headers["x-kvgate-replica"] == "c0"  # roles still keep it off P and D
        await rig.settle()


async def test_vllm_decoder_serves_whole_requests_when_splitting_does_not_pay(
    rig_factory: Any,
) -> None:
    # llm-d style: a decode replica prefills locally unless remote prefill pays.
    async with rig_factory([P, D], mode="auto", min_uncached_tokens=10**6) as rig:
        resp = await rig.chat()
        assert resp.headers["x-kvgate-replica"] == "d0"
        assert (
            rig.metric(
                "kvgate_pd_decisions_total",
                model="kvgate-sim",
                decision="colocated",
                reason="uncached_below_threshold",
            )
            == 1
        )
        (whole,) = rig.records("d0")
        assert whole.pd is None and rig.records("p0") == []
        await rig.settle()


async def test_session_split_once_then_continues_on_its_decoder(rig_factory: Any) -> None:
    async with rig_factory([B, P, D], mode="auto", min_uncached_tokens=1024) as rig:
        turn1 = [{"role": "user", "content": _text(1500, "s")}]
        resp = await rig.http.post(
            "/v1/chat/completions",
            headers=SESSION,
            json={"model": "kvgate-sim", "messages": turn1, "max_tokens": 4},
        )
        assert resp.headers["x-kvgate-replica"] == "d0"  # long and uncached: split
        turn2 = turn1 + [
            {"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": _text(300, "t")},
        ]
        resp = await rig.http.post(
            "/v1/chat/completions",
            headers=SESSION,
            json={"model": "kvgate-sim", "messages": turn2, "max_tokens": 4},
        )
        # The KV is on d0 now: the next turn prefills its few new tokens there.
        assert resp.headers["x-kvgate-replica"] == "d0"
        assert [r.pd for r in rig.records("d0")] == ["decode", None]
        assert rig.records("d0")[1].cached_tokens > 1000
        assert len(rig.records("p0")) == 1
        await rig.settle()


async def test_sglang_cluster_without_colocated_replica_splits(rig_factory: Any) -> None:
    async with rig_factory(
        [P, D], protocol="sglang", mode="auto", min_uncached_tokens=10**6
    ) as rig:
        resp = await rig.chat()
        assert resp.headers["x-kvgate-replica"] == "d0"
        assert (
            rig.metric(
                "kvgate_pd_decisions_total",
                model="kvgate-sim",
                decision="disaggregate",
                reason="no_colocated_replica",
            )
            == 1
        )
        (dec,) = rig.records("d0")
        assert dec.pd == "decode"
        await rig.settle()
