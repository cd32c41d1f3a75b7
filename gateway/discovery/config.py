"""The `discovery:` section: DNS names whose records are the replicas behind the gateway."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.discovery.resolve import parse_nameserver
from gateway.types import Role


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DnsTarget(_Section):
    """One DNS name; every address it resolves to is one replica."""

    name: str = Field(
        ...,
        min_length=1,
        description="DNS name, e.g. _http._tcp.vllm.default.svc.cluster.local "
        "(SRV) or vllm.default.svc.cluster.local (A/AAAA); a relative name uses the resolver's "
        "search domains",
    )
    record: Literal["srv", "a"] = Field(
        "srv",
        description="srv: port from each record, id from its target name; a: every A "
        "(else AAAA) address on `port`, id from the address",
    )
    port: int | None = Field(None, ge=1, le=65535, description="engine port (record: a only)")
    scheme: Literal["http", "https"] = "http"
    weight: float = Field(1.0, gt=0, le=1000, description="ring share of each replica found")
    models: tuple[str, ...] = Field((), description="models served; empty = discover")
    pool: str | None = Field(None, description="hardware pool of every replica found")
    role: Role = Field(Role.BOTH, description="both | prefill | decode")
    price_per_hour: float = Field(0.0, ge=0, description="cost per hour of each replica found")

    @model_validator(mode="after")
    def _port_for_a(self) -> DnsTarget:
        if self.record == "a" and self.port is None:
            raise ValueError("record: a needs a port (A records carry none)")
        if self.record == "srv" and self.port is not None:
            raise ValueError("record: srv takes each record's own port; remove `port`")
        return self


class DiscoverySettings(_Section):
    dns: tuple[DnsTarget, ...] = Field((), description="DNS names to resolve (empty = off)")
    interval_s: float = Field(10.0, gt=0, description="seconds between two resolutions")
    timeout_s: float = Field(2.0, gt=0, description="one resolution's time limit")
    nameservers: tuple[str, ...] = Field(
        (),
        description="'ip' or 'ip:port' of the DNS servers to ask; empty = the system's resolv.conf",
    )
    remove_after: int = Field(
        2,
        ge=1,
        le=100,
        description="consecutive resolutions a replica must be missing from "
        "before it leaves the ring (a record missing once, e.g. a truncated answer, moves "
        "no session)",
    )

    @field_validator("nameservers")
    @classmethod
    def _addresses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for text in value:
            try:
                parse_nameserver(text)
            except ValueError:
                raise ValueError(
                    f"{text!r} is not 'ip' or 'ip:port' (a nameserver is an address)"
                ) from None
        return value
