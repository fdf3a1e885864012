"""Real Redis servers for tests: a standalone server per test (`redis_server` fixture, a
`RedisServer` a test may `kill()` and `start()` again) and a 3-master Cluster per session
(`redis_cluster`), started from the `redis-server` binary on free loopback ports (no fakes).
The fixtures themselves are registered in tests/conftest.py, for every test package.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from extproc.stack import free_port as stack_free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed")


def free_port(*, with_bus: bool = False) -> int:
    """A free loopback port below the ephemeral range (extproc.stack.free_port says why)
    and, for Cluster, a free bus port at +10000."""
    return stack_free_port(paired=10_000 if with_bus else 0)


def _wait_ping(port: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"redis on {port} did not start")


@dataclass
class RedisServer:
    """One `redis-server` process (no persistence) that tests may kill and restart."""

    port: int
    workdir: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_ping(self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed")
    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@dataclass
class RedisClusterNodes:
    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli not installed")
    nodes = []
    try:
        for i in range(3):
            workdir = tmp_path_factory.mktemp(f"cluster{i}")
            port = free_port(with_bus=True)
            node = RedisServer(
                port,
                workdir,
                (
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-node-timeout",
                    "2000",
                ),
            )
            node.start()
            nodes.append(node)
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        _wait_cluster_ok(nodes)
        yield RedisClusterNodes(nodes)
    finally:
        for node in nodes:
            node.kill()


def _wait_cluster_ok(nodes: list[RedisServer], timeout_s: float = 15.0) -> None:
    assert REDIS_CLI is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [
            subprocess.run(
                [REDIS_CLI, "-p", str(n.port), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
            for n in nodes
        ]
        if all("cluster_state:ok" in s for s in states):
            return
        time.sleep(0.1)
    raise RuntimeError("cluster did not become ready")
