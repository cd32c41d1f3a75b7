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


async def test_engine_arguments_override_the_profile_and_show_in_metrics() -> None:
    args = parse(
        [
            "sim",
            "--profile",
            "tiny",
            "--port",
            "0",
            "--num-gpu-blocks",
            "32",
            "--max-num-seqs",
            "3",
            "--max-num-batched-tokens",
            "256",
            "--max-model-len",
            "300",
            "--gpu-memory-utilization",
            "0.8",
            "--flavor",
            "sglang",
        ]
    )
    profile = cli.profile_from_args(args)
    assert (
        profile.num_gpu_blocks,
        profile.max_num_seqs,
        profile.max_num_batched_tokens,
        profile.max_model_len,
        profile.gpu_memory_utilization,
    ) == (32, 3, 256, 300, 0.8)
    async with (
        cli.cluster_from_args(args) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as client,
    ):
        info = (await client.get("/server_info")).json()
        models = (await client.get("/v1/models")).json()
    assert info["max_running_requests"] == 3 and info["chunked_prefill_size"] == 256
    assert info["max_total_num_tokens"] == 32 * 16 and info["mem_fraction_static"] == 0.8
    assert models["data"][0]["max_model_len"] == 300


async def test_vllm_flavour_reports_blocks_and_utilisation_and_no_server_info() -> None:
    args = parse(
        [
            "sim",
            "--profile",
            "tiny",
            "--port",
            "0",
            "--num-gpu-blocks",
            "48",
            "--gpu-memory-utilization",
            "0.75",
        ]
    )
    async with (
        cli.cluster_from_args(args) as cluster,
        httpx.AsyncClient(base_url=cluster.urls[0]) as client,
    ):
        text = (await client.get("/metrics")).text
        missing = await client.get("/server_info")
    assert 'gpu_memory_utilization="0.75"' in text and 'num_gpu_blocks="48"' in text
    assert missing.status_code == 404


def test_engine_arguments_out_of_range() -> None:
    with pytest.raises(ValueError, match="--max-num-seqs is out of range"):
        cli.profile_from_args(parse(["sim", "--max-num-seqs", "0"]))
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        cli.profile_from_args(parse(["sim", "--gpu-memory-utilization", "1.5"]))
