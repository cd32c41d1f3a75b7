"""The engine model's clocks (gateway.sim.clock): wall time scaled, and virtual time that
moves only forward and only when driven."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.sim.clock import RealClock, VirtualClock


@pytest.mark.parametrize("scale", [0, -1.0])
def test_a_real_clock_needs_a_positive_scale(scale: float) -> None:
    with pytest.raises(ValueError, match="time_scale must be positive"):
        RealClock(scale)


def test_a_sped_up_clock_runs_faster_than_the_wall() -> None:
    clock = RealClock(20.0)
    wall0, sim0 = time.monotonic(), clock.now()
    time.sleep(0.05)
    wall, sim = time.monotonic() - wall0, clock.now() - sim0
    assert sim == pytest.approx(wall * 20.0, rel=0.5)  # loose: the machine is shared
    assert clock.to_real(2.0) == 0.1


async def test_a_sped_up_sleep_takes_its_share_of_real_time() -> None:
    clock = RealClock(10.0)
    t0 = time.monotonic()
    await clock.sleep(0.5)  # 0.05 s of wall time
    took = time.monotonic() - t0
    assert 0.045 <= took < 0.4
    t0 = time.monotonic()
    await clock.sleep(-3.0)  # a deadline already past: no wait
    assert time.monotonic() - t0 < 0.05


async def test_virtual_time_moves_only_forward_and_only_when_driven() -> None:
    clock = VirtualClock(5.0)
    assert clock.now() == 5.0
    clock.advance(1.5)
    clock.advance_to(4.0)  # in the past: ignored
    assert clock.now() == 6.5
    clock.advance_to(9.0)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-0.1)
    assert clock.now() == 9.0
    t0 = time.monotonic()
    await clock.sleep(3600.0)  # an hour of simulated time at once
    await clock.sleep(-1.0)
    assert clock.now() == 9.0 + 3600.0
    assert time.monotonic() - t0 < 0.5


async def test_virtual_sleepers_yield_to_each_other() -> None:
    clock = VirtualClock()
    order: list[str] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        order.append(name)

    await asyncio.gather(sleeper("a", 1.0), sleeper("b", 2.0))
    assert sorted(order) == ["a", "b"]
    assert clock.now() == 3.0  # each sleep advances the shared time
