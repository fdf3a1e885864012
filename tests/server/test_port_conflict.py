"""Two `extproc serve` on the same ports: the second says so in one line and exits non-zero
before opening any port; the first keeps serving. Readiness waits for every port."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health_pb2

from extproc.server.ports import PortInUse, check_ports
from extproc.stack import free_port, grpc_health_status, wait_until
from tests.conftest import ENDPOINTS


def serve(port: int, health: int, admin: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "extproc", "serve", "--plaintext"),
            *("--endpoints", ",".join(ENDPOINTS), "--host", "127.0.0.1"),
            *("--port", str(port), "--health-port", str(health), "--admin-port", str(admin)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def first() -> Iterator[tuple[int, int, int]]:
    ports = free_port(), free_port(), free_port()
    proc = serve(*ports)
    try:
        wait_until(
            lambda: (
                grpc_health_status(ports[1], "readiness") == health_pb2.HealthCheckResponse.SERVING
            ),
            timeout_s=60,
            what="first picker",
            proc=proc,
        )
        yield ports
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("shared", ["all", "admin"])
def test_second_picker_on_taken_ports_exits_with_one_line(first, shared):
    port, health, admin = first
    if shared == "admin":
        # Only the admin port clashes: the ext_proc and health ports must never open.
        port, health = free_port(), free_port()
    second = serve(port, health, admin)
    out, _ = second.communicate(timeout=90)
    assert second.returncode == 1, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    taken = admin if shared == "admin" else port
    assert f"127.0.0.1:{taken}" in lines[0] and "already in use" in lines[0], out
    assert "Traceback" not in out
    if shared == "admin":
        assert not listening(port) and not listening(health)
    # The first picker was not disturbed.
    assert grpc_health_status(first[1], "readiness") == health_pb2.HealthCheckResponse.SERVING


def test_check_ports_names_the_port_and_skips_port_zero():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        check_ports("127.0.0.1", {"ext_proc": 0})
        with pytest.raises(PortInUse, match=f"health port 127.0.0.1:{busy}"):
            check_ports("127.0.0.1", {"ext_proc": free_port(), "health": busy})
