"""DNS lookups for discovery, through dnspython's asyncio resolver (never blocks the loop).

An authoritative "nothing there" (NXDOMAIN, or no record of the type) is an empty answer:
the target has no replicas now. A timeout or a failing server is a `DiscoveryError`: the
caller keeps what it knew, so a DNS outage never empties the ring.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdatatype
import dns.resolver

if TYPE_CHECKING:
    from gateway.discovery.config import DnsTarget


class DiscoveryError(Exception):
    """A lookup that failed (timeout, server failure): the answer is unknown, not empty."""


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    host: str  # names the replica: the SRV target (no trailing dot) or the address
    address: str  # what to connect to
    port: int


def parse_nameserver(text: str) -> tuple[str, int]:
    """'10.0.0.10', '10.0.0.10:5353', '::1' or '[::1]:5353' -> (address, port)."""
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest.startswith(":"):
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        port = int(p)
    ipaddress.ip_address(host)  # ValueError for a name: nameservers must be addresses
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return host, port


def url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class DnsResolver:
    """Resolves `DnsTarget`s. No answer cache: every round asks the servers again."""

    def __init__(self, nameservers: Sequence[str] = (), timeout_s: float = 2.0) -> None:
        resolver = dns.asyncresolver.Resolver(configure=not nameservers)
        if nameservers:
            parsed = [parse_nameserver(n) for n in nameservers]
            resolver.nameservers = [host for host, _ in parsed]
            resolver.nameserver_ports = dict(parsed)
        resolver.lifetime = timeout_s
        resolver.timeout = timeout_s
        resolver.cache = None
        self._resolver = resolver

    async def lookup(self, target: DnsTarget) -> list[Endpoint]:
        if target.record == "srv":
            return await self._srv(target.name)
        assert target.port is not None  # checked by DnsTarget
        addresses = await self._addresses(target.name)
        return sorted(Endpoint(a, a, target.port) for a in addresses)

    async def _query(self, name: str | dns.name.Name, rdtype: str) -> dns.resolver.Answer | None:
        try:
            return await self._resolver.resolve(name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return None
        except dns.exception.Timeout as exc:
            raise DiscoveryError(
                f"{rdtype} {name}: no answer in {self._resolver.lifetime} s"
            ) from exc
        except dns.exception.DNSException as exc:
            raise DiscoveryError(f"{rdtype} {name}: {exc}") from exc

    async def _addresses(self, name: str | dns.name.Name) -> list[str]:
        for rdtype in ("A", "AAAA"):
            answer = await self._query(name, rdtype)
            if answer is not None:
                return sorted({r.address for r in answer})
        return []

    async def _srv(self, name: str) -> list[Endpoint]:
        answer = await self._query(name, "SRV")
        if answer is None:
            return []
        # Servers usually send the targets' addresses along: use them, ask only for the rest.
        glue: dict[dns.name.Name, list[str]] = {}
        for rrset in answer.response.additional:
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                glue.setdefault(rrset.name, []).extend(r.address for r in rrset)
        found: set[Endpoint] = set()
        for record in answer:
            target = record.target
            host = target.to_text(omit_final_dot=True)
            addresses = glue.get(target) or await self._addresses(target)
            # One replica per SRV record: a target with several addresses is one engine.
            if addresses:
                found.add(Endpoint(host, min(addresses), record.port))
        return sorted(found)
