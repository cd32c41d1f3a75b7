"""A real DNS server on loopback (dnslib, UDP, its own thread) with a zone tests edit live."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSServer


@dataclass
class Zone:
    """name -> records. SRV values are (target, port); A/AAAA values are addresses."""

    srv: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    a: dict[str, list[str]] = field(default_factory=dict)
    aaaa: dict[str, list[str]] = field(default_factory=dict)
    glue: bool = True  # send the SRV targets' A records in the additional section
    servfail: bool = False
    queries: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _key(name: object) -> str:
    return str(name).rstrip(".").lower()


class _ZoneResolver(BaseResolver):  # type: ignore[misc]
    def __init__(self, zone: Zone) -> None:
        self.zone = zone

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        qname, qtype = request.q.qname, QTYPE[request.q.qtype]
        name = _key(qname)
        z = self.zone
        with z.lock:
            z.queries.append((name, qtype))
            if z.servfail:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            known = name in z.srv or name in z.a or name in z.aaaa
            if qtype == "SRV" and name in z.srv:
                for target, port in z.srv[name]:
                    reply.add_answer(RR(qname, QTYPE.SRV, ttl=5, rdata=SRV(0, 100, port, target)))
                    if z.glue:
                        for address in z.a.get(_key(target), []):
                            reply.add_ar(RR(target, QTYPE.A, ttl=5, rdata=A(address)))
            elif qtype == "A" and name in z.a:
                for address in z.a[name]:
                    reply.add_answer(RR(qname, QTYPE.A, ttl=5, rdata=A(address)))
            elif qtype == "AAAA" and name in z.aaaa:
                for address in z.aaaa[name]:
                    reply.add_answer(RR(qname, QTYPE.AAAA, ttl=5, rdata=AAAA(address)))
            elif not known:
                reply.header.rcode = RCODE.NXDOMAIN
        return reply


@contextlib.contextmanager
def dns_server(zone: Zone) -> Iterator[str]:
    """Serve `zone` on 127.0.0.1; yields the 'ip:port' to put under discovery.nameservers."""
    server = DNSServer(_ZoneResolver(zone), port=0, address="127.0.0.1", logger=_Quiet())
    server.start_thread()
    try:
        host, port = server.server.server_address
        yield f"{host}:{port}"
    finally:
        server.stop()
        server.server.server_close()


class _Quiet:
    """dnslib's logger interface, silenced (it prints every query otherwise)."""

    def __getattr__(self, name: str) -> object:
        return lambda *args: None
