"""DnsResolver against a real DNS server on loopback (dnslib)."""

from __future__ import annotations

import socket

import pytest

from gateway.discovery.config import DnsTarget
from gateway.discovery.resolve import DiscoveryError, DnsResolver, Endpoint, parse_nameserver
from tests.discovery.dns_server import Zone, dns_server

SRV_NAME = "_http._tcp.vllm.test"


def zone() -> Zone:
    return Zone(
        srv={SRV_NAME: [("vllm-0.vllm.test", 8001), ("vllm-1.vllm.test", 8002)]},
        a={
            "vllm-0.vllm.test": ["10.0.0.1"],
            "vllm-1.vllm.test": ["10.0.0.2"],
            "vllm.test": ["10.0.0.9", "10.0.0.3"],
        },
        aaaa={"v6.test": ["fd00::5"]},
    )


@pytest.mark.parametrize("glue", [True, False])
async def test_srv_records_with_and_without_glue(glue: bool) -> None:
    z = zone()
    z.glue = glue
    with dns_server(z) as ns:
        found = await DnsResolver([ns]).lookup(DnsTarget(name=SRV_NAME))
    assert found == [
        Endpoint("vllm-0.vllm.test", "10.0.0.1", 8001),
        Endpoint("vllm-1.vllm.test", "10.0.0.2", 8002),
    ]
    asked_for_a = [q for q in z.queries if q[1] == "A"]
    assert bool(asked_for_a) is not glue  # glue saves the follow-up queries


async def test_a_records_fall_back_to_aaaa() -> None:
    with dns_server(zone()) as ns:
        resolver = DnsResolver([ns])
        v4 = await resolver.lookup(DnsTarget(name="vllm.test", record="a", port=8000))
        v6 = await resolver.lookup(DnsTarget(name="v6.test", record="a", port=8000))
    assert v4 == [Endpoint("10.0.0.3", "10.0.0.3", 8000), Endpoint("10.0.0.9", "10.0.0.9", 8000)]
    assert v6 == [Endpoint("fd00::5", "fd00::5", 8000)]


async def test_nxdomain_and_no_records_are_empty_answers() -> None:
    with dns_server(zone()) as ns:
        resolver = DnsResolver([ns])
        assert await resolver.lookup(DnsTarget(name="_http._tcp.gone.test")) == []
        # The name exists but has no SRV record.
        assert await resolver.lookup(DnsTarget(name="vllm.test")) == []


async def test_server_failure_and_silence_are_errors_not_empty() -> None:
    z = zone()
    z.servfail = True
    with dns_server(z) as ns, pytest.raises(DiscoveryError, match="SRV"):
        await DnsResolver([ns]).lookup(DnsTarget(name=SRV_NAME))
    # A UDP port nobody answers on: the lookup times out.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        port = silent.getsockname()[1]
        with pytest.raises(DiscoveryError, match="no answer"):
            await DnsResolver([f"127.0.0.1:{port}"], timeout_s=0.3).lookup(DnsTarget(name=SRV_NAME))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.10", ("10.0.0.10", 53)),
        ("10.0.0.10:5353", ("10.0.0.10", 5353)),
        ("::1", ("::1", 53)),
        ("[::1]:5353", ("::1", 5353)),
    ],
)
def test_parse_nameserver(text: str, expected: tuple[str, int]) -> None:
    assert parse_nameserver(text) == expected


@pytest.mark.parametrize("text", ["kube-dns", "10.0.0.1:0", "10.0.0.1:x"])
def test_parse_nameserver_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_nameserver(text)


def test_target_port_rules() -> None:
    with pytest.raises(ValueError, match="needs a port"):
        DnsTarget(name="x", record="a")
    with pytest.raises(ValueError, match="own port"):
        DnsTarget(name="x", port=80)
