from __future__ import annotations

import argparse

import httpx
import pytest

from gateway.sim import cli
from gateway.sim.clock import RealClock, VirtualClock
from gateway.types import Role


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvgate")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_sim_subcommand_arguments() -> None:
    args = parse(
        [
            "sim",
            "--replicas",
            "4",
            "--port",
            "9000",
            "--profile",
            "h200-dense",
            "--flavor",
            "sglang",
            "--time-scale",
            "5",
            "--seed",
            "3",
            "--role",
            "prefill",
            "--role",
            "decode",
            "--priority-scheduling",
        ]
    )
    assert args.handler is cli.run
    cluster = cli.cluster_from_args(args)
    assert len(cluster.engines) == 4 and cluster.base_port == 9000
    assert [e.role for e in cluster.engines] == [Role.PREFILL] + [Role.DECODE] * 3
    first = cluster.engines[0]
    assert first.profile.name == "h200-dense" and first.flavor == "sglang"
    assert first.priority_scheduling and first.runner.clock.time_scale == 5
    assert [e.seed for e in cluster.engines] == [3, 4, 5, 6]
    assert not first.faults.config.active


def test_fault_flags() -> None:
    args = parse(["sim", "--fault-error", "503", "--fault-refuse-for", "2", "--fault-replica", "1"])
    config = cli.fault_config(args)
    assert config.error == 503 and config.refuse and config.refuse_for == 2
    cluster = cli.cluster_from_args(args)
    assert not cluster.engines[0].faults.config.active


def test_unknown_profile_is_rejected() -> None:
    with pytest.raises(SystemExit):
        parse(["sim", "--profile", "nope"])


async def test_cluster_built_from_flags_serves() -> None:
    args = parse(["sim", "--replicas", "2", "--port", "0", "--profile", "instant"])
    async with cli.cluster_from_args(args) as cluster, httpx.AsyncClient() as c:
        for url in cluster.urls:
            assert (await c.get(url + "/health")).status_code == 200


def test_clocks() -> None:
    v = VirtualClock()
    v.advance(1.5)
    v.advance_to(1.0)
    assert v.now() == 1.5
    with pytest.raises(ValueError):
        v.advance(-1)
    fast = RealClock(time_scale=100.0)
    assert fast.to_real(1.0) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        RealClock(0)
