"""`store.url` -> a redis-py client: one server, a Sentinel-watched master, or a Cluster.

Three shapes of URL, so an operator moves from one Redis to a highly available one by
changing one setting:

* `redis://[user:password@]host:port/db`, `rediss://...`, `unix:///path.sock`: one server
  (redis-py's own URL parsing).
* `redis+sentinel://[user:password@]host1:26379,host2:26379/SERVICE[/db]` (or
  `rediss+sentinel://`): the master of SERVICE as the Sentinels name it. The password is
  the data servers'; Sentinels that need their own take `?sentinel_password=...`. After a
  failover the client reconnects to the new master (redis-py's Sentinel pool).
* `redis+cluster://[user:password@]host1:6379,host2:6379` (or `rediss+cluster://`): a
  Redis Cluster, seeded from any of its nodes; redis-py learns the slot map itself.

Parsing is pure and table-tested; opening a client does no I/O (redis-py connects lazily).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel

Mode = Literal["single", "sentinel", "cluster"]
# What the store and the quota limiter talk to; both speak the same commands.
RedisClient = Redis | RedisCluster

SINGLE_SCHEMES = ("redis://", "rediss://", "unix://")
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
SCHEMES = SINGLE_SCHEMES + SENTINEL_SCHEMES + CLUSTER_SCHEMES
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_PORT = 6379


class StoreUrlError(ValueError):
    """A `store.url` that names no Redis kvgate can reach."""


@dataclass(frozen=True, slots=True)
class StoreTarget:
    """What `store.url` names, without secrets in its repr."""

    mode: Mode
    url: str = field(repr=False)  # the single-server URL as given (mode "single")
    hosts: tuple[tuple[str, int], ...] = ()  # sentinels or cluster seeds
    service: str = ""  # the Sentinel service (master) name
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        """Where the store is, for log lines (never the password)."""
        if self.mode == "single":
            parts = urlsplit(self.url)
            if parts.scheme == "unix":
                return f"unix:{parts.path}"
            return f"{parts.hostname}:{parts.port or DEFAULT_PORT}"
        seeds = ",".join(f"{h}:{p}" for h, p in self.hosts)
        if self.mode == "sentinel":
            return f"sentinel {self.service} via {seeds}"
        return f"cluster via {seeds}"


def _hosts(netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hosts: list[tuple[str, int]] = []
    for item in netloc.split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("["):  # [ipv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest.lstrip(":")
        else:
            host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError as exc:
            raise StoreUrlError(f"store.url: bad port in {item!r}") from exc
        if not host or not 0 < port < 65536:
            raise StoreUrlError(f"store.url: bad host in {item!r}")
        hosts.append((host, port))
    if not hosts:
        raise StoreUrlError("store.url names no host")
    return tuple(hosts)


def parse_store_url(url: str) -> StoreTarget:
    """The target `url` names; raises `StoreUrlError` with the reason."""
    if url.startswith(SINGLE_SCHEMES):
        return StoreTarget("single", url, tls=url.startswith("rediss://"))
    if not url.startswith(SENTINEL_SCHEMES + CLUSTER_SCHEMES):
        raise StoreUrlError(
            "store.url must start with " + ", ".join(s.removesuffix("://") for s in SCHEMES)
        )
    scheme, _, rest = url.partition("://")
    # Several hosts do not parse as one netloc: split the credentials and path by hand.
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    userinfo, at, hostpart = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    options = {k: v[-1] for k, v in parse_qs(query).items()}
    tls = scheme.startswith("rediss")
    if scheme.endswith("+cluster"):
        if path.strip("/") not in ("", "0"):
            raise StoreUrlError("store.url: a Redis Cluster has only database 0")
        return StoreTarget(
            "cluster",
            url,
            _hosts(hostpart, DEFAULT_PORT),
            tls=tls,
            username=username,
            password=password,
        )
    segments = [s for s in path.split("/") if s]
    if not segments:
        raise StoreUrlError("store.url: a Sentinel URL names its service: .../SERVICE[/db]")
    try:
        db = int(segments[1]) if len(segments) > 1 else 0
    except ValueError as exc:
        raise StoreUrlError(f"store.url: bad database {segments[1]!r}") from exc
    return StoreTarget(
        "sentinel",
        url,
        _hosts(hostpart, DEFAULT_SENTINEL_PORT),
        service=unquote(segments[0]),
        db=db,
        tls=tls,
        username=username,
        password=password,
        sentinel_password=options.get("sentinel_password"),
    )


def open_redis(target: StoreTarget, **options: Any) -> RedisClient:
    """A client for `target`; `options` are redis-py connection options (timeouts, retry,
    client_name). No I/O until the first command."""
    return _open(target, options, Redis, RedisCluster, ClusterNode, Sentinel)  # type: ignore[no-any-return]


def open_sync_redis(target: StoreTarget, **options: Any) -> Any:
    """The blocking twin of `open_redis`, for command-line tools (`kvgate keys`)."""
    from redis import Redis as SyncRedis
    from redis.cluster import ClusterNode as SyncNode
    from redis.cluster import RedisCluster as SyncCluster
    from redis.sentinel import Sentinel as SyncSentinel

    return _open(target, options, SyncRedis, SyncCluster, SyncNode, SyncSentinel)


def _open(
    target: StoreTarget,
    options: dict[str, Any],
    single: Any,
    cluster: Any,
    node: Any,
    sentinels: Any,
) -> Any:
    if target.mode == "single":
        return single.from_url(target.url, **options)
    auth: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.tls:
        auth["ssl"] = True
    if target.mode == "cluster":
        nodes = [node(host, port) for host, port in target.hosts]
        return cluster(startup_nodes=nodes, **auth, **options)
    sentinel_kwargs: dict[str, Any] = {
        k: options[k] for k in ("socket_connect_timeout", "socket_timeout") if k in options
    }
    if target.sentinel_password is not None:
        sentinel_kwargs["password"] = target.sentinel_password
    watch = sentinels(list(target.hosts), sentinel_kwargs=sentinel_kwargs, **auth, **options)
    return watch.master_for(target.service, db=target.db)


async def drop_idle_connections(client: RedisClient) -> None:
    """Close pooled connections nobody is using: after a Redis restart (or a failover) each
    would otherwise fail once on first use."""
    if isinstance(client, RedisCluster):
        for node in client.get_nodes():
            await node.disconnect_free_connections()
        return
    await client.connection_pool.disconnect(inuse_connections=False)
