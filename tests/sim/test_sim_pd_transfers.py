"""The sim's PD hand-off beyond the two-stage relay (gateway.sim.generate, the /sim/kv and
/sim/bootstrap endpoints): vLLM's Mooncake connector naming a router-minted transfer id, a
decode leg whose pull fails (an unreachable or empty prefill: it recomputes), SGLang's
bootstrap releasing a held leg once; and the pieces under them (the stored Responses, the
runner's instant and untracked paths, the tokenizer's id rules)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from sim_helpers import chat_body, test_profile

from gateway.sim.cluster import SimCluster
from gateway.sim.engine import EngineModel, SimRequest
from gateway.sim.profiles import get_profile
from gateway.sim.runner import EngineRunner, EngineStopped
from gateway.sim.server import SimEngine
from gateway.sim.stored import ResponseStore
from gateway.sim.tokenizer import approx_token_ids, render_chat, token_ids_text
from gateway.sim.wire import WireError

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "A design document for a routing gateway, to be summarised. " * 8


class Pair:
    def __init__(self, cluster: SimCluster) -> None:
        self.prefill: SimEngine = cluster.engines[0]
        self.decode: SimEngine = cluster.engines[1]
        self.http = httpx.AsyncClient(timeout=10)

    async def chat(self, engine: SimEngine, rid: str, **extra: Any) -> httpx.Response:
        return await self.http.post(
            engine.url + "/v1/chat/completions",
            json=chat_body(PROMPT, **extra),
            headers={"X-Request-Id": rid},
        )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair() -> AsyncIterator[Pair]:
    async with SimCluster(
        2, test_profile(), roles=["prefill", "decode"], bootstrap_timeout_s=0.3
    ) as cluster:
        p = Pair(cluster)
        try:
            yield p
        finally:
            await p.http.aclose()


async def test_mooncake_transfer_ids_hand_the_kv_over_once(pair: Pair) -> None:
    prefill, decode = pair.prefill, pair.decode
    first = await pair.chat(
        prefill,
        "mc-1",
        max_tokens=50,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-1"},
    )
    body = first.json()
    # The router named the transfer: no parameters come back, one token was made.
    assert body["kv_transfer_params"] is None
    assert body["usage"]["completion_tokens"] == 1
    assert prefill.transfers == {"t-1": "mc-1"} and prefill.model.is_held("mc-1")
    kv = {
        "do_remote_prefill": True,
        "remote_bootstrap_addr": prefill.url,
        "transfer_id": "t-1",
    }
    second = await pair.chat(decode, "mc-1", max_tokens=3, ignore_eos=True, kv_transfer_params=kv)
    use = second.json()["usage"]
    assert use["prompt_tokens_details"]["cached_tokens"] == use["prompt_tokens"] - 1
    assert prefill.transfers == {} and not prefill.model.is_held("mc-1")
    assert prefill.blocks_in_use == 0 and decode.kv_pull_failures == 0
    assert decode.request_log[-1].kv_transfer_params == kv
    # The same transfer again: nothing is held any more, the decode leg recomputes.
    again = await pair.chat(decode, "mc-2", max_tokens=1, kv_transfer_params=kv)
    assert again.status_code == 200 and decode.kv_pull_failures == 1
    # What it finds cached is its own prefix cache (whole blocks), nothing came over.
    reused = again.json()["usage"]
    assert reused["prompt_tokens_details"]["cached_tokens"] == (use["prompt_tokens"] - 1) // 16 * 16
    assert decode.request_log[-1].transfer_bytes == 0


@pytest.mark.parametrize(
    "kv",
    [
        {"do_remote_prefill": True},  # no host, no port: nowhere to pull from
        {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1},
    ],
)
async def test_a_decode_leg_that_cannot_pull_recomputes(pair: Pair, kv: dict[str, Any]) -> None:
    before, received = pair.decode.kv_pull_failures, pair.decode.model.stats.kv_rx_bytes
    reply = await pair.chat(pair.decode, f"fail-{len(kv)}", max_tokens=2, kv_transfer_params=kv)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    assert pair.decode.kv_pull_failures == before + 1
    assert pair.decode.model.stats.kv_rx_bytes == received
    assert pair.decode.request_log[-1].pd == "decode"
    assert pair.decode.request_log[-1].transfer_bytes == 0


async def test_sglang_bootstrap_releases_a_held_leg_once(pair: Pair) -> None:
    prefill, decode = pair.prefill, pair.decode
    room = {"bootstrap_host": prefill.host, "bootstrap_port": prefill.port, "bootstrap_room": 9}
    legs = await asyncio.gather(
        pair.chat(prefill, "room-9", max_tokens=30, **room),
        pair.chat(decode, "room-9", max_tokens=2, ignore_eos=True, **room),
    )
    assert [leg.status_code for leg in legs] == [200, 200]
    assert legs[0].json()["usage"]["completion_tokens"] == 1
    assert decode.request_log[-1].pd == "decode" and prefill.request_log[-1].pd == "prefill"
    assert 9 not in prefill.rooms and prefill.model.num_held == 0
    assert (await pair.http.get(f"{prefill.url}/sim/bootstrap/9")).status_code == 404


async def test_a_bootstrap_that_never_comes_is_a_500_after_the_timeout(pair: Pair) -> None:
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.prefill.port, "bootstrap_room": 5}
    before = pair.decode.kv_pull_failures
    reply = await pair.chat(pair.decode, "lonely", max_tokens=2, **room)
    assert reply.status_code == 500
    assert "KV bootstrap for room 5 timed out" in reply.json()["error"]["message"]
    assert pair.decode.kv_pull_failures == before + 1
    assert pair.decode.request_log[-1].status == 500


# ---- stored Responses -------------------------------------------------------------------------


async def test_the_store_is_bounded_and_a_cancelled_answer_stays_cancelled() -> None:
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"r{i}", ({"role": "user", "content": str(i)},), {"status": "completed"})
    assert len(store) == 2 and "r0" not in store and store.history("r0") is None
    with pytest.raises(WireError) as gone:
        store.get("r0")
    assert gone.value.status == 404
    store.put("r1", (), {"status": "queued"})
    assert store.history("r1") == () and store.get("r1")["status"] == "queued"
    cancelled = await store.cancel("r1")
    assert cancelled["status"] == "cancelled"
    store.put("r1", ({"role": "assistant", "content": "late"},), {"status": "completed"})
    store.set_status("r1", "failed", "too late")
    assert store.get("r1")["status"] == "cancelled"  # a late finish does not overwrite it
    store.set_status("r2", "failed", "boom")
    assert store.get("r2")["error"] == {"code": "server_error", "message": "boom"}
    store.set_status("r2", "in_progress")
    assert store.get("r2")["error"] is None
    store.set_status("nobody", "failed")  # unknown ids are ignored


async def test_closing_the_store_cancels_background_work() -> None:
    store = ResponseStore(capacity=4)
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(forever())
    store.put("bg", (), {"status": "in_progress"}, task)
    await started.wait()
    await store.close()
    assert task.cancelled()
    with pytest.raises(WireError):
        await store.cancel("missing")


# ---- the runner -------------------------------------------------------------------------------


async def test_the_instant_runner_finishes_on_submit_and_untracked_handles_fail() -> None:
    model = EngineModel(get_profile("instant"))
    runner = EngineRunner(model)
    await runner.start()  # instant: no step loop to start
    handle = runner.submit(SimRequest("i", 100, (), max_tokens=5))
    assert handle.finished and handle.output_tokens == 5
    assert [n async for n in runner.stream(handle)] == [5]
    assert not runner.abort(handle)  # finished: nothing to abort
    stranger = EngineModel(get_profile("instant")).submit(SimRequest("s", 10, (), max_tokens=2), 0)
    with pytest.raises(EngineStopped, match="not tracked"):
        await runner.wait(stranger)
    await runner.stop()


async def test_a_runner_whose_loop_failed_refuses_new_work() -> None:
    model = EngineModel(test_profile())
    runner = EngineRunner(model)
    runner.error = RuntimeError("gone")
    with pytest.raises(EngineStopped, match="engine loop failed"):
        runner.submit(SimRequest("x", 10, (), max_tokens=1))
    assert model.num_waiting == 0


# ---- token ids ------------------------------------------------------------------------------


async def test_token_ids_are_bytes_for_ascii_and_hashes_otherwise() -> None:
    assert list(approx_token_ids("abcdefg")) == [
        int.from_bytes(b"abcd", "little"),
        int.from_bytes(b"efg\0", "little"),
    ]
    wide = list(approx_token_ids("héllo wörld"))
    assert len(wide) == 3 and all(0 <= t < 2**31 for t in wide)
    assert wide == list(approx_token_ids("héllo wörld"))  # deterministic
    assert token_ids_text([1, 0xABCD, 0x1FFFF]) == "0001abcdffff"
    assert len(approx_token_ids(token_ids_text(list(range(50))))) == 50


async def test_the_chat_template_renders_every_content_shape() -> None:
    rendered = render_chat(
        [
            {"content": "no role"},
            {"role": "user", "content": None},
            {"role": "user", "content": ["plain", {"text": " part"}, {"image": 1}]},
            {"role": "tool", "content": 42},
        ]
    )
    assert rendered == (
        "<|user|>\nno role<|end|>\n"
        "<|user|>\n<|end|>\n"
        "<|user|>\nplain part<|end|>\n"
        "<|tool|>\n42<|end|>\n"
        "<|assistant|>\n"
    )
