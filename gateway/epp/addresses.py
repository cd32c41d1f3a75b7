"""Replica ids <-> the `ip:port` strings of the EPP protocol.

Envoy's ORIGINAL_DST cluster connects to the address in the destination header, so a
replica's URL must carry an IP literal (DNS discovery's A records and InferencePool pods
do; a host name is passed as written and is the operator's to resolve).
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from gateway.types import ReplicaId, ReplicaState


def address_of(url: str) -> str:
    """`ip:port` of a replica URL (`[v6]:port` for IPv6; the scheme's port when none)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class AddressBook:
    """Both directions for the current members, rebuilt only when membership changed
    (`Cluster.set_members` installs a new mapping: its identity is the version)."""

    __slots__ = ("_by_address", "_by_replica", "_members")

    def __init__(self) -> None:
        self._members: object = None
        self._by_replica: dict[ReplicaId, str] = {}
        self._by_address: dict[str, ReplicaId] = {}

    def _sync(self, members: Mapping[ReplicaId, ReplicaState]) -> None:
        if members is not self._members:
            self._by_replica = {rid: address_of(r.url) for rid, r in members.items()}
            self._by_address = {a: rid for rid, a in self._by_replica.items()}
            self._members = members

    def address(self, members: Mapping[ReplicaId, ReplicaState], replica: ReplicaId) -> str:
        self._sync(members)
        return self._by_replica[replica]

    def replica(self, members: Mapping[ReplicaId, ReplicaState], address: str) -> ReplicaId | None:
        self._sync(members)
        return self._by_address.get(address)
