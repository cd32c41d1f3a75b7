"""The sessions panel over HTTP: each conversation the gateway served shows once, on the
replica that answered its every turn, with its request count and under a digest of its
session id; the spread adds up."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tests.console.test_guard import console_over_http


async def test_each_conversation_is_live_once_on_the_replica_that_served_it() -> None:
    async with console_over_http(engines=2, console={"measure": "always"}) as http:
        served: dict[str, set[str]] = {}
        for turn in range(3):
            for i in range(4):
                body: dict[str, Any] = {
                    "model": "kvgate-sim",
                    "messages": [{"role": "user", "content": f"talk {i} turn {turn}"}],
                    "max_tokens": 4,
                }
                resp = await http.post(
                    "/v1/chat/completions", json=body, headers={"x-session-id": f"conv-{i}"}
                )
                assert resp.status_code == 200
                served.setdefault(f"conv-{i}", set()).add(resp.headers["x-kvgate-replica"])
        # Sticky: every turn of a conversation went to one replica.
        assert all(len(replicas) == 1 for replicas in served.values()), served
        panel = (await http.get("/admin/sessions")).json()
        assert panel["measuring"] is True
        assert panel["live"] == 4 and panel["tracked"] >= 4
        rows = panel["hottest"]
        # Keys are digests: a client's session id is not shown to whoever reads the console.
        assert all(row["key"].startswith("h:") and "conv-" not in row["key"] for row in rows)
        assert Counter((r["replica"], r["requests"], r["moves"], r["source"]) for r in rows) == (
            Counter((next(iter(r)), 3, 0, "header") for r in served.values())
        )
        expected = Counter(next(iter(r)) for r in served.values())
        assert {k: v for k, v in panel["spread"].items() if v} == dict(expected)
        assert sum(panel["spread"].values()) == panel["live"]
