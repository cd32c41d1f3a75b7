"""Who is calling: a `Principal` per API key, found by the key's SHA-256 in a `KeyRing`.

Keys are never kept in clear: the ring maps hex digests to principals. A key's grants are
narrowed by its tenant's (the stricter ceiling, the key's model and pool lists when it has
them, else the tenant's); the key's and the tenant's quotas both apply.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from gateway.auth.config import Grants, KeySettings, Limits

NO_LIMITS = Limits()


def hash_key(key: str | bytes) -> str:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    name: str  # the key's label
    tenant: str
    admin: bool = False
    max_priority: str | None = None
    models: frozenset[str] = frozenset()
    pools: frozenset[str] = frozenset()
    key_limits: Limits = NO_LIMITS
    tenant_limits: Limits = NO_LIMITS

    @property
    def limited(self) -> bool:
        return self.key_limits.any or self.tenant_limits.any


def _stricter(a: str | None, b: str | None, order: Sequence[str]) -> str | None:
    if a is None or b is None:
        return a or b
    rank = {name: i for i, name in enumerate(order)}
    return a if rank.get(a, len(order)) >= rank.get(b, len(order)) else b


def principal_of(
    key: KeySettings, tenants: Mapping[str, Grants], classes: Sequence[str]
) -> Principal:
    tenant_name = key.tenant or key.name
    tenant = tenants.get(tenant_name) or Grants()
    return Principal(
        name=key.name,
        tenant=tenant_name,
        admin=key.admin,
        max_priority=_stricter(key.max_priority, tenant.max_priority, classes),
        models=frozenset(key.models or tenant.models),
        pools=frozenset(key.pools or tenant.pools),
        key_limits=key.limits,
        tenant_limits=tenant.limits,
    )


def digest_of(key: KeySettings) -> str:
    if key.key_sha256 is not None:
        return key.key_sha256
    assert key.key is not None
    return hash_key(key.key.get_secret_value())


class KeyRing:
    """Digest -> principal, from static keys (config, file, environment) and a replaceable
    shared part (the Redis store). Lookups read one immutable mapping."""

    def __init__(
        self,
        static: Iterable[KeySettings],
        tenants: Mapping[str, Grants],
        classes: Sequence[str],
    ) -> None:
        self._tenants = dict(tenants)
        self._classes = tuple(classes)
        self._static = self._build(static)
        self._all: Mapping[str, Principal | None] = self._static

    def _build(self, keys: Iterable[KeySettings]) -> Mapping[str, Principal | None]:
        # A disabled key maps to None: known, and refused as revoked.
        return MappingProxyType(
            {
                digest_of(k): None if k.disabled else principal_of(k, self._tenants, self._classes)
                for k in keys
            }
        )

    def replace_shared(self, keys: Iterable[KeySettings]) -> None:
        """The shared keys as last read; a static entry with the same digest wins."""
        shared = self._build(keys)
        self._all = MappingProxyType({**shared, **self._static})

    def lookup(self, key: str | bytes) -> Principal | None:
        return self._all.get(hash_key(key))

    def __len__(self) -> int:
        return len(self._all)
