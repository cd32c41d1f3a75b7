"""Highly available Redis for the tests: a Sentinel-watched master with a replica, and a
three-master Cluster, all real `redis-server` processes on loopback ports."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

import redis

from tests.store.conftest import RedisServer, _ephemeral_low, server_port


def _wait(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Sentinels:
    """A master, one replica of it, and one Sentinel (quorum 1) that fails over quickly."""

    SERVICE = "kvm"

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.master = RedisServer(binary, server_port())
        self.replica = RedisServer(binary, server_port())
        self.sentinel_port = server_port()
        self.sentinel: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.SERVICE}/0"

    def start(self) -> None:
        self.master.start()
        self.replica.start()
        with self.replica.client() as r:
            r.replicaof("127.0.0.1", self.master.port)
        conf = self.workdir / "sentinel.conf"  # Sentinel rewrites its own file
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndaemonize no\n"
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.SERVICE} 400\n"
            f"sentinel failover-timeout {self.SERVICE} 2000\n"
        )
        self.sentinel = subprocess.Popen(
            [self.binary, str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait(lambda: self.master_port() == self.master.port, 10, "the sentinel")
        _wait(self._replica_synced, 10, "the replica to sync")

    def _replica_synced(self) -> bool:
        with self.replica.client() as r:
            info = r.info("replication")
        return bool(info.get("master_link_status") == "up")

    def master_port(self) -> int:
        with redis.Redis(port=self.sentinel_port, socket_timeout=1) as s:
            host_port = s.sentinel_get_master_addr_by_name(self.SERVICE)
        return int(host_port[1])

    def wait_failover(self, timeout: float = 20.0) -> None:
        _wait(lambda: self.master_port() == self.replica.port, timeout, "the failover")

    def stop(self) -> None:
        if self.sentinel is not None:
            self.sentinel.kill()
            self.sentinel.wait()
        self.master.kill()
        self.replica.kill()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too, both below the
    ephemeral range (where a client socket could take them)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 14000), low - 10000)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


class Cluster:
    """Three masters, no replicas: the slot map spread by `redis-cli --cluster create`."""

    def __init__(self, binary: str, workdir: Path, size: int = 3) -> None:
        self.binary = binary
        self.workdir = workdir
        self.ports: list[int] = []
        while len(self.ports) < size:
            if (port := _cluster_port()) not in self.ports:
                self.ports.append(port)
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    def start(self) -> None:
        for port in self.ports:
            node_dir = self.workdir / f"node{port}"
            node_dir.mkdir()
            self.processes.append(
                subprocess.Popen(
                    [
                        self.binary,
                        "--port", str(port),
                        "--bind", "127.0.0.1",
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf",
                        "--dir", str(node_dir),
                        "--save", "",
                        "--appendonly", "no",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
        for port in self.ports:
            _wait(lambda p=port: redis.Redis(port=p).ping(), 10, f"redis-server on {port}")
        cli = Path(self.binary).with_name("redis-cli")
        subprocess.run(
            [str(cli), "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
            + ["--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait(self._ok, 40, "the cluster to agree")

    def _ok(self) -> bool:
        with redis.Redis(port=self.ports[0]) as r:
            return bool(r.cluster("info").get("cluster_state") == "ok")

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.ports[0])

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
