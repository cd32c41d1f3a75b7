"""`kvgate keys`: hash a key for the config, or manage the keys shared through Redis.

The store comes from the gateway's own config (`-c`, `store.url` and `store.key_prefix`,
KVGATE_STORE__* on top). Secret keys are read from standard input or a file, never from
the command line, where shell history and `ps` would keep them. Any failure is one line
on stderr with its cause, and a non-zero exit.
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson

from gateway.auth.principal import hash_key
from gateway.errors import ConfigError
from gateway.store.keys import StoreKeys

KEY_PREFIX = "sk-kvgate-"


class KeysError(Exception):
    """A failure to report in one line (exit 1)."""


def _redacted(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _store(args: argparse.Namespace) -> tuple[str, str, str]:
    """(url, key prefix, where the url came from): --redis/--prefix over the config's store."""
    from gateway.settings import load_settings

    try:
        store = load_settings(args.config).store
    except ConfigError as exc:
        raise KeysError(" ".join(line.strip() for line in exc.message.splitlines())) from None
    source = f"store.url in {args.config}" if args.config else "store.url (default)"
    if args.redis:
        source = "--redis"
    return args.redis or store.url, args.prefix or store.key_prefix, source


def _client(args: argparse.Namespace) -> tuple[Any, str]:
    from gateway.store.connect import StoreUrlError, open_sync_redis, parse_store_url

    url, prefix, source = _store(args)
    try:
        target = parse_store_url(url)
        client = open_sync_redis(target, socket_connect_timeout=2, socket_timeout=2)
    except StoreUrlError as exc:
        raise KeysError(f"bad Redis URL ({source}): {exc}") from None
    except ValueError as exc:
        raise KeysError(f"bad Redis URL {_redacted(url)!r} ({source}): {exc}") from None
    where = _redacted(url) if target.mode == "single" else target.describe()
    args.store_where = f"{where} ({source})"
    return client, prefix


def _secret(args: argparse.Namespace) -> str | None:
    """The key from --key-file (a path, or - for standard input); None when not given."""
    path = args.key_file
    if path is None:
        return None
    try:
        if path == "-" and sys.stdin.isatty():
            text = getpass.getpass("key: ")  # typed, not echoed
        else:
            text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise KeysError(f"cannot read key file {path!r}: {exc.strerror or exc}") from None
    key = text.strip()
    if not key or "\n" in key:
        raise KeysError(f"key file {path!r}: expected one key on one line")
    return key


def _hash(args: argparse.Namespace) -> int:
    key = _secret(args)
    print(hash_key(key or ""))
    return 0


def _add(args: argparse.Namespace) -> int:
    key = _secret(args) or KEY_PREFIX + secrets.token_urlsafe(24)
    record: dict[str, Any] = {"name": args.name}
    for field in ("tenant", "max_priority"):
        if getattr(args, field):
            record[field] = getattr(args, field)
    if args.models:
        record["models"] = args.models.split(",")
    if args.pools:
        record["pools"] = args.pools.split(",")
    if args.admin:
        record["admin"] = True
    limits = {
        name: value
        for name, value in (
            ("requests_per_minute", args.rpm),
            ("input_tokens_per_minute", args.input_tpm),
            ("output_tokens_per_minute", args.output_tpm),
            ("concurrent_requests", args.concurrent),
        )
        if value is not None
    }
    if limits:
        record["limits"] = limits
    client, prefix = _client(args)
    client.hset(StoreKeys(prefix).api_keys(), hash_key(key), orjson.dumps(record))
    print(key)
    return 0


def _records(client: Any, prefix: str) -> dict[str, dict[str, Any]]:
    raw = client.hgetall(StoreKeys(prefix).api_keys())
    return {d.decode(): orjson.loads(v) for d, v in raw.items()}


def _revoke(args: argparse.Namespace) -> int:
    key = _secret(args)
    if (args.target is None) == (key is None):
        raise KeysError("revoke takes a name or digest, or --key-file (not both)")
    client, prefix = _client(args)
    hkey = StoreKeys(prefix).api_keys()
    if key is not None:
        digests, shown = [hash_key(key)], "the key in --key-file"
    else:
        target = args.target
        digests = [d for d, r in _records(client, prefix).items() if target in (d, r.get("name"))]
        shown = repr(target)
    removed = sum(int(client.hdel(hkey, d)) for d in digests)
    if not removed:
        print(f"kvgate keys: no shared key named or hashed {shown}", file=sys.stderr)
        return 1
    print(f"revoked {removed} key(s)")
    return 0


def _list(args: argparse.Namespace) -> int:
    client, prefix = _client(args)
    records = sorted(_records(client, prefix).items(), key=lambda kv: str(kv[1].get("name")))
    for digest, record in records:
        print(f"{digest[:12]}  {orjson.dumps(record).decode()}")
    return 0


def _one_line(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Redis and input failures as one line with the cause, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        from redis.exceptions import RedisError

        try:
            return handler(args)
        except KeysError as exc:
            print(f"kvgate keys: {exc}", file=sys.stderr)
            return 1
        except RedisError as exc:
            where = getattr(args, "store_where", "Redis")
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            print(f"kvgate keys: Redis at {where}: {cause}", file=sys.stderr)
            return 1

    return run


def register(sub: Any) -> None:
    keys = sub.add_parser("keys", help="API keys: hash one, or add/revoke/list shared ones")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    key_file = {
        "metavar": "FILE",
        "help": "read the key from FILE (- for standard input), never from the command line",
    }
    # No abbreviations: `--key sk-...` must fail, not pass for --key-file.
    h = ksub.add_parser(
        "hash", help="print the sha256 to put in auth.keys[].key_sha256", allow_abbrev=False
    )
    h.add_argument("--key-file", default="-", **key_file)
    h.set_defaults(handler=_one_line(_hash))
    for name, handler, text in (
        ("add", _add, "create a key in Redis (prints the key once)"),
        ("revoke", _revoke, "delete a shared key, by name, digest or the key itself"),
        ("list", _list, "list the shared keys (digests, never keys)"),
    ):
        p = ksub.add_parser(name, help=text, allow_abbrev=False)
        p.add_argument(
            "-c",
            "--config",
            default=os.environ.get("KVGATE_CONFIG_FILE") or None,
            help="the gateway's YAML settings: its store.url and store.key_prefix"
            " (default: $KVGATE_CONFIG_FILE; KVGATE_STORE__* apply on top)",
        )
        p.add_argument("--redis", help="Redis URL instead of the config's store.url")
        p.add_argument("--prefix", help="key prefix instead of the config's store.key_prefix")
        p.set_defaults(handler=_one_line(handler))
        if name == "add":
            p.add_argument("--name", required=True, help="the key's name (for revoke and logs)")
            p.add_argument("--key-file", **key_file)
            p.add_argument("--tenant", help="tenant its usage is counted under")
            p.add_argument(
                "--max-priority", dest="max_priority", help="highest admission class it may ask"
            )
            p.add_argument("--models", help="models it may use, comma-separated")
            p.add_argument("--pools", help="pools it may use, comma-separated")
            p.add_argument("--admin", action="store_true", help="may use /admin/* (and /metrics)")
            p.add_argument("--rpm", type=int, help="requests per minute")
            p.add_argument("--input-tpm", dest="input_tpm", type=int, help="input tokens/minute")
            p.add_argument(
                "--output-tpm", dest="output_tpm", type=int, help="output tokens per minute"
            )
            p.add_argument("--concurrent", type=int, help="requests in flight at once")
        elif name == "revoke":
            p.add_argument("target", nargs="?", help="the key's name or sha256 digest")
            p.add_argument("--key-file", **key_file)
