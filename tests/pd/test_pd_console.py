"""The console's PD panel (`GET /admin/pd`) against a real PD rig: decisions by reason and
hand-offs, as counted in the gateway's own series."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.types import Role

B, P, D = Role.BOTH, Role.PREFILL, Role.DECODE


async def test_pd_panel_counts_decisions_by_reason_and_handoffs(rig_factory: Any) -> None:
    async with rig_factory([B, P, D]) as rig:
        for _ in range(2):
            resp = await rig.chat()
            assert resp.status_code == 200, resp.text
        await rig.settle()
        console = rig.state.extras["console"]
        console.sampler.sample_once()  # what the lifespan task does every interval
        panel = (await rig.http.get("/admin/pd")).json()
        assert panel["enabled"] is True
        assert [(d["decision"], d["reason"], d["count"]) for d in panel["decisions"]] == [
            ("disaggregate", "mode_always", 2)
        ]
        assert panel["handoffs"] == [{"protocol": "vllm", "outcome": "served", "count": 2}]
        await asyncio.sleep(0)
