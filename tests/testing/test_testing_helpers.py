from __future__ import annotations

import pytest

from gateway.testing.clock import FakeClock
from gateway.testing.views import ViewBuilder, make_request


def test_fake_clock() -> None:
    clock = FakeClock(5.0)
    assert clock() == 5.0 and clock.advance(2.5) == 7.5 and clock() == 7.5
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_view_builder() -> None:
    view = (
        ViewBuilder(now=100.0)
        .replicas(3)
        .unhealthy("r1")
        .weight("r2", 2.0)
        .models("r0", "m")
        .load("r0", waiting=4, running=2, age=1.0)
        .load("r2", waiting=1, age=10.0)
        .inflight(r0=3, r2=1)
        .build()
    )
    assert [r.id for r in view.healthy()] == ["r0", "r2"]
    assert view.by_id["r2"].weight == 2.0 and view.by_id["r0"].models == {"m"}
    loaded = view.load_of(view.by_id["r0"])
    assert loaded is not None and loaded.waiting == 4
    assert view.load_of(view.by_id["r2"]) is None  # older than stale_after
    assert view.inflight("r0") == 3 and view.inflight("r1") == 0


def test_make_request() -> None:
    req = make_request("s", model="x", prompt_tokens=10)
    assert req.session_key == "s" and req.model == "x" and req.prompt_tokens == 10
