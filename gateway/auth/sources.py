"""Where keys come from: the config (and so the environment), a file, the Redis store."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import orjson
import yaml
from pydantic import ValidationError
from redis.exceptions import RedisError

from gateway.auth.config import AuthSettings, KeySettings
from gateway.auth.principal import KeyRing
from gateway.errors import ConfigError
from gateway.store.redis import RedisStore

log = logging.getLogger("kvgate.auth")


def read_keys_file(path: Path) -> list[KeySettings]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"auth.keys_file {str(path)!r}: {exc}") from exc
    if isinstance(data, dict):
        data = data.get("keys")
    if not isinstance(data, list):
        raise ConfigError(f"auth.keys_file {str(path)!r}: expected a list of keys")
    try:
        return [KeySettings.model_validate(entry) for entry in data]
    except ValidationError as exc:
        raise ConfigError(f"auth.keys_file {str(path)!r}: {exc}") from exc


def static_keys(settings: AuthSettings) -> list[KeySettings]:
    keys = list(settings.keys)
    if settings.keys_file is not None:
        keys += read_keys_file(settings.keys_file)
    return keys


def decode_record(digest: str, raw: bytes) -> KeySettings | None:
    try:
        fields = orjson.loads(raw)
        fields.pop("key", None)
        return KeySettings.model_validate({**fields, "key_sha256": digest})
    except (orjson.JSONDecodeError, ValidationError, AttributeError, TypeError):
        log.warning("ignoring the malformed Redis key record %s...", digest[:8])
        return None


class RedisKeys:
    """A `Service` re-reading the shared keys every `refresh_s`: a key added or revoked
    with `kvgate keys` is seen by every gateway within that. Redis unavailable: the keys
    last read stay in force."""

    def __init__(self, store: RedisStore, ring: KeyRing, refresh_s: float) -> None:
        self.store = store
        self.ring = ring
        self.refresh_s = refresh_s
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        raw = await self.store.redis.hgetall(self.store.keys.api_keys())
        keys = [decode_record(_text(d), _bytes(v)) for d, v in raw.items()]
        self.ring.replace_shared(k for k in keys if k is not None)

    async def start(self) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.store.settings.connect_timeout_s * 2):
                await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="kvgate-auth-keys")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                async with asyncio.timeout(self.store.settings.connect_timeout_s * 2):
                    await self.refresh()
            except (RedisError, OSError, TimeoutError) as exc:
                log.debug("reading shared API keys failed, keeping the last ones: %s", exc)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value
