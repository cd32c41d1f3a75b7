"""`store.url` parsing: every shape an operator writes, and the mistakes they make."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.store.connect import StoreUrlError, open_redis, parse_store_url


@pytest.mark.parametrize(
    ("url", "mode", "hosts", "service", "db", "tls"),
    [
        ("redis://localhost:6379/0", "single", (), "", 0, False),
        ("rediss://cache.internal:6380/2", "single", (), "", 0, True),
        ("unix:///run/redis.sock", "single", (), "", 0, False),
        (
            "redis+sentinel://s1:26379,s2:26380,s3/kvgate",
            "sentinel",
            (("s1", 26379), ("s2", 26380), ("s3", 26379)),
            "kvgate",
            0,
            False,
        ),
        (
            "rediss+sentinel://u:p%40ss@s1,s2/main/3?sentinel_password=x",
            "sentinel",
            (("s1", 26379), ("s2", 26379)),
            "main",
            3,
            True,
        ),
        (
            "redis+cluster://n1:7000,n2:7001,[::1]:7002",
            "cluster",
            (("n1", 7000), ("n2", 7001), ("::1", 7002)),
            "",
            0,
            False,
        ),
        ("redis+cluster://n1", "cluster", (("n1", 6379),), "", 0, False),
    ],
)
def test_each_shape_parses(
    url: str, mode: str, hosts: tuple[tuple[str, int], ...], service: str, db: int, tls: bool
) -> None:
    target = parse_store_url(url)
    assert (target.mode, target.hosts, target.service, target.db, target.tls) == (
        mode,
        hosts,
        service,
        db,
        tls,
    )


def test_credentials_are_unquoted_and_kept_out_of_descriptions() -> None:
    target = parse_store_url("redis+sentinel://app:p%40ss@s1:26379/main?sentinel_password=sp")
    assert (target.username, target.password, target.sentinel_password) == ("app", "p@ss", "sp")
    assert "p@ss" not in repr(target) and "sp" not in target.describe()
    assert target.describe() == "sentinel main via s1:26379"
    single = parse_store_url("redis://:secret@db.internal:6380/1")
    assert single.describe() == "db.internal:6380"
    assert "secret" not in repr(single)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://localhost:6379", "must start with"),
        ("localhost:6379", "must start with"),
        ("redis+sentinel://s1,s2", "names its service"),
        ("redis+sentinel://s1/main/zero", "bad database"),
        ("redis+sentinel://s1:port/main", "bad port"),
        ("redis+cluster://n1:99999", "bad host"),
        ("redis+cluster://", "names no host"),
        ("redis+cluster://n1/2", "only database 0"),
    ],
)
def test_mistakes_name_the_reason(url: str, reason: str) -> None:
    with pytest.raises(StoreUrlError, match=reason):
        parse_store_url(url)


def test_open_redis_builds_the_client_the_url_names_without_connecting() -> None:
    # Nothing listens on these ports: opening must not touch the network.
    assert isinstance(open_redis(parse_store_url("redis://127.0.0.1:1/0")), Redis)
    assert isinstance(open_redis(parse_store_url("redis+cluster://127.0.0.1:1")), RedisCluster)
    master = open_redis(parse_store_url("redis+sentinel://127.0.0.1:1/main/2"))
    assert isinstance(master, Redis)
    assert master.connection_pool.connection_kwargs["db"] == 2
