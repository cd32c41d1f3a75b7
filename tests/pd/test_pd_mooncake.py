"""vLLM's MooncakeConnector (issue 44): the router mints the transfer id. The prefill leg
gets `{do_remote_decode, transfer_id}` and answers no params; the decode leg gets the same
`transfer_id`, `remote_engine_id` and `remote_bootstrap_addr` ("http://host:port") and pulls
the blocks there. Wire shape from vLLM 0.33 `mooncake/mooncake_connector.py`."""

from __future__ import annotations

from typing import Any

import openai

from gateway.types import Role

B, P, D = Role.BOTH, Role.PREFILL, Role.DECODE


async def test_mooncake_handoff_mints_a_transfer_id_for_both_legs(rig_factory: Any) -> None:
    async with (
        rig_factory([B, P, D], protocol="vllm-mooncake") as rig,
        openai.AsyncOpenAI(base_url=rig.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        stream = await client.chat.completions.create(
            model="kvgate-sim",
            messages=[{"role": "user", "content": "x " * 4000}],
            max_tokens=6,
            stream=True,
        )
        text = ""
        async for part in stream:
            if part.choices:
                text += part.choices[0].delta.content or ""
        assert text
        await rig.settle()
        (pre,) = rig.records("p0")
        (dec,) = rig.records("d0")
        assert rig.records("c0") == []
        assert pre.pd == "prefill" and dec.pd == "decode"
        sent_p, sent_d = pre.kv_transfer_params, dec.kv_transfer_params
        assert sent_p["do_remote_decode"] is True and sent_p["do_remote_prefill"] is False
        transfer_id = sent_p["transfer_id"]
        assert isinstance(transfer_id, str) and transfer_id
        p0 = rig.engine("p0")
        assert sent_d == {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": f"http://127.0.0.1:{p0.port}",
            "remote_engine_id": "p0",
        }
        # The decoder pulled the blocks under that transfer id: no wasted prefill.
        assert dec.transfer_bytes > 0 and rig.engine("d0").kv_pull_failures == 0
        assert p0.model.num_held == 0
        assert (
            rig.metric("kvgate_pd_handoffs_total", protocol="vllm-mooncake", outcome="served") == 1
        )


async def test_each_request_gets_its_own_transfer_id(rig_factory: Any) -> None:
    async with rig_factory([P, D], protocol="vllm-mooncake") as rig:
        for i in range(2):
            resp = await rig.chat(content=f"{i} " + "y " * 3000)
            assert resp.status_code == 200, resp.text
        await rig.settle()
        ids = {r.kv_transfer_params["transfer_id"] for r in rig.records("p0")}
        assert len(ids) == 2
        assert [r.kv_transfer_params["transfer_id"] for r in rig.records("d0")] == [
            r.kv_transfer_params["transfer_id"] for r in rig.records("p0")
        ]
