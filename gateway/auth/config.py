"""`auth:` settings section: API keys, tenants, their ceilings and quotas."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Limits(_Frozen):
    """Quotas of a key or a tenant; None: no limit. Windows slide over one minute."""

    requests_per_minute: int | None = Field(None, ge=1)
    input_tokens_per_minute: int | None = Field(
        None, ge=1, description="prompt tokens: estimated from the body, settled from `usage`"
    )
    output_tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="completion tokens: max_tokens (or a default) at dispatch, past it as "
        "they stream, settled from `usage`; never below what was delivered",
    )
    concurrent_requests: int | None = Field(None, ge=1)

    @property
    def any(self) -> bool:
        return any(
            v is not None
            for v in (
                self.requests_per_minute,
                self.input_tokens_per_minute,
                self.output_tokens_per_minute,
                self.concurrent_requests,
            )
        )


class Grants(_Frozen):
    """What a key or a tenant may use (empty: anything)."""

    max_priority: str | None = Field(
        None,
        description="best priority class it may ask for (admission.classes order); "
        "requests naming a better one get 403, requests naming none get this class at best",
    )
    models: tuple[str, ...] = Field((), description="models it may call (public names)")
    pools: tuple[str, ...] = Field((), description="card pools its requests may land on")
    limits: Limits = Field(default_factory=Limits)


class KeySettings(Grants):
    """One API key. Give `key_sha256` (the hex SHA-256 of the key, `kvgate keys hash`);
    `key` (the key itself, hashed at load) is for tests and the environment only."""

    name: str = Field(..., min_length=1, max_length=64, description="label in metrics and logs")
    key_sha256: str | None = None
    key: SecretStr | None = None
    tenant: str | None = Field(None, description="tenant it acts for (default: its name)")
    admin: bool = Field(False, description="may call /admin/* and /metrics")
    disabled: bool = Field(False, description="revoked: refused with 401")

    @field_validator("key_sha256")
    @classmethod
    def _hex(cls, value: str | None) -> str | None:
        if value is not None and not _SHA256.match(value.lower()):
            raise ValueError("must be 64 hex characters (sha256 of the key)")
        return value.lower() if value is not None else None

    @model_validator(mode="after")
    def _one_secret(self) -> KeySettings:
        if (self.key_sha256 is None) == (self.key is None):
            raise ValueError("give exactly one of key_sha256 or key")
        return self


class AuthSettings(_Frozen):
    keys: tuple[KeySettings, ...] = Field((), description="API keys (KVGATE_AUTH__KEYS: JSON)")
    keys_file: Path | None = Field(
        None, description="YAML or JSON file holding a list of keys, same fields as `keys`"
    )
    redis_keys: bool = Field(
        False,
        description="also read keys from the shared store's Redis (store.backend: "
        "redis), managed with `kvgate keys`; re-read every `redis_refresh_s`",
    )
    redis_refresh_s: float = Field(0.5, gt=0, le=60)
    quota_timeout_s: float = Field(
        0.25,
        gt=0,
        le=5,
        description="budget of the one Redis call a quota check makes; past "
        "it (or while the store is degraded) this gateway's own counts decide",
    )
    tenants: dict[str, Grants] = Field(
        default_factory=dict, description="tenant name -> ceilings and quotas shared by its keys"
    )
    metrics_need_admin: bool = Field(
        True, description="with keys on, GET /metrics needs an admin key (false: any key)"
    )
    cache_salt: bool = Field(
        True,
        description="give each tenant's chat and completion requests a `cache_salt` of "
        "its own (vLLM and SGLang key their prefix caches by it), so one tenant's prompts "
        "never warm another's cache; a client's own salt is kept within its tenant's",
    )
    credential_headers: tuple[str, ...] = Field(
        (),
        description="more request headers that carry client credentials (beyond "
        "Authorization, x-api-key and api-key): never forwarded to the engines",
    )
    default_output_tokens: int = Field(
        256, ge=1, description="output tokens charged up front for a request without max_tokens"
    )

    @property
    def enabled(self) -> bool:
        return bool(self.keys) or self.keys_file is not None or self.redis_keys
