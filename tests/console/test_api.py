"""The console's JSON over HTTP: `/admin/history?since=` answers bad values with a clear
400 and good ones with exactly the samples after them."""

from __future__ import annotations

import asyncio

from tests.console.test_guard import assert_openai_error, console_over_http

FAST_SAMPLES = {"sample_interval_s": 0.05, "idle_sample_interval_s": 0.05, "measure": "always"}


async def test_history_refuses_a_since_that_is_not_a_finite_number_and_cuts_at_a_good_one() -> None:
    async with console_over_http(console=FAST_SAMPLES) as http:
        for raw in ("yesterday", "", "nan", "inf", "-inf", "1e400"):
            resp = await http.get("/admin/history", params={"since": raw})
            assert_openai_error(resp, 400, "invalid_request_error")
            assert resp.json()["error"]["param"] == "since"
            assert repr(raw) in resp.json()["error"]["message"]
        samples: list[dict[str, float]] = []
        for _ in range(100):  # the sampler runs every 50 ms: a few samples within a second
            samples = (await http.get("/admin/history")).json()
            if len(samples) >= 3:
                break
            await asyncio.sleep(0.05)
        assert len(samples) >= 3
        times = [s["t"] for s in samples]
        assert times == sorted(times)
        for cut in times[:-1]:
            later = (await http.get("/admin/history", params={"since": repr(cut)})).json()
            assert [s["t"] for s in later][: len([t for t in times if t > cut])] == [
                t for t in times if t > cut
            ]
            assert all(s["t"] > cut for s in later)
        # Far in the future: nothing yet, and an empty array rather than an error.
        assert (await http.get("/admin/history", params={"since": "1e12"})).json() == []
        assert len((await http.get("/admin/history", params={"since": "-1"})).json()) >= 3
