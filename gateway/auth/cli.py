"""`kvgate keys`: hash a key for the config, or manage the keys shared through Redis."""

from __future__ import annotations

import argparse
import secrets
import sys
from typing import Any

import orjson

from gateway.auth.principal import hash_key
from gateway.store.keys import StoreKeys

KEY_PREFIX = "sk-kvgate-"


def _client(args: argparse.Namespace) -> Any:
    from redis import Redis

    return Redis.from_url(args.redis, socket_connect_timeout=2, socket_timeout=2)


def _hash(args: argparse.Namespace) -> int:
    print(hash_key(args.key))
    return 0


def _add(args: argparse.Namespace) -> int:
    key = args.key or KEY_PREFIX + secrets.token_urlsafe(24)
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
    _client(args).hset(StoreKeys(args.prefix).api_keys(), hash_key(key), orjson.dumps(record))
    print(key)
    return 0


def _records(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    raw = _client(args).hgetall(StoreKeys(args.prefix).api_keys())
    return {d.decode(): orjson.loads(v) for d, v in raw.items()}


def _revoke(args: argparse.Namespace) -> int:
    client = _client(args)
    hkey = StoreKeys(args.prefix).api_keys()
    target = args.target
    digests = [d for d, r in _records(args).items() if target in (d, r.get("name"))]
    if not digests and target.startswith(KEY_PREFIX):
        digests = [hash_key(target)]
    removed = sum(int(client.hdel(hkey, d)) for d in digests)
    if not removed:
        print(f"kvgate keys: no shared key named or hashed {target!r}", file=sys.stderr)
        return 1
    print(f"revoked {removed} key(s)")
    return 0


def _list(args: argparse.Namespace) -> int:
    for digest, record in sorted(_records(args).items(), key=lambda kv: str(kv[1].get("name"))):
        print(f"{digest[:12]}  {orjson.dumps(record).decode()}")
    return 0


def register(sub: Any) -> None:
    keys = sub.add_parser("keys", help="API keys: hash one, or add/revoke/list shared ones")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    h = ksub.add_parser("hash", help="print the sha256 to put in auth.keys[].key_sha256")
    h.add_argument("key")
    h.set_defaults(handler=_hash)
    for name, handler, text in (
        ("add", _add, "create a key in Redis (prints the key once)"),
        ("revoke", _revoke, "delete a shared key, by name, digest or the key itself"),
        ("list", _list, "list the shared keys (digests, never keys)"),
    ):
        p = ksub.add_parser(name, help=text)
        p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="store.url")
        p.add_argument("--prefix", default="kvgate", help="store.key_prefix")
        p.set_defaults(handler=handler)
        if name == "add":
            p.add_argument("--name", required=True)
            p.add_argument("--key", help="use this key instead of a random one")
            p.add_argument("--tenant")
            p.add_argument("--max-priority", dest="max_priority")
            p.add_argument("--models", help="comma-separated")
            p.add_argument("--pools", help="comma-separated")
            p.add_argument("--admin", action="store_true")
            p.add_argument("--rpm", type=int)
            p.add_argument("--input-tpm", dest="input_tpm", type=int)
            p.add_argument("--output-tpm", dest="output_tpm", type=int)
            p.add_argument("--concurrent", type=int)
        elif name == "revoke":
            p.add_argument("target")
