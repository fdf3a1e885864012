"""Envoy speaks TLS to a picker with a self-signed certificate (`extproc envoy-config
--extproc-tls`, `server.tls.self_signed`): requests are routed and the TLS handshakes show in
Envoy's stats."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2

from extproc.bootstrap import BootstrapOptions, render_bootstrap
from extproc.stack import envoy_binary, free_port, grpc_health_status, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello over tls"}]}


class Procs:
    """Child processes stopped on exit, each logging to a file in `dir`."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def test_envoy_routes_through_a_tls_picker_with_a_self_signed_certificate(procs, tmp_path):
    upstream = f"127.0.0.1:{free_port()}"
    up = procs.spawn("upstream", [sys.executable, "-m", "extproc.sim.echo", upstream])
    wait_until(
        lambda: httpx.get(f"http://{upstream}/health", timeout=0.5).status_code == 200,
        timeout_s=20,
        what="upstream",
        proc=up,
    )
    port, health, listen, admin = free_port(), free_port(), free_port(), free_port()
    config = tmp_path / "picker.yaml"
    config.write_text(yaml.safe_dump({"server": {"tls": {"self_signed": True}}}))
    picker = procs.spawn(
        "extproc",
        [
            *(sys.executable, "-m", "extproc", "--log-format", "json", "serve"),
            *("--config", str(config), "--endpoints", upstream, "--host", "127.0.0.1"),
            *("--port", str(port), "--health-port", str(health), "--admin-port", "0"),
        ],
    )
    wait_until(
        lambda: grpc_health_status(health, "readiness") == health_pb2.HealthCheckResponse.SERVING,
        timeout_s=20,
        what="extproc (plaintext health port)",
        proc=picker,
    )
    bootstrap = render_bootstrap(
        BootstrapOptions(
            listen_port=listen,
            listen_address="127.0.0.1",
            extproc=f"127.0.0.1:{port}",
            admin_port=admin,
            extproc_tls=True,
            extproc_sni="localhost",
        )
    )
    (tmp_path / "envoy.yaml").write_text(bootstrap)
    envoy = procs.spawn(
        "envoy",
        [
            *(envoy_binary(), "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart"),
            *("--concurrency", "1", "--log-level", "warn"),
        ],
    )

    def stat(name: str) -> int:
        text = httpx.get(f"http://127.0.0.1:{admin}/stats", params={"filter": name}).text
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    # Envoy health-checks the picker over TLS before it sends it any stream.
    wait_until(
        lambda: stat("cluster.extproc.membership_healthy") == 1,
        timeout_s=30,
        what="picker healthy in envoy",
        proc=envoy,
    )
    with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=10) as c:
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, (tmp_path / "envoy.log").read_text()
            assert r.json()["destination_header"] == upstream
    assert stat("cluster.extproc.ssl.handshake") >= 1
    assert stat("cluster.extproc.ssl.connection_error") == 0
