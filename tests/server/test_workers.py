"""`extproc serve --workers N`: workers share the ext_proc and health ports (SO_REUSEPORT),
each has its own admin port, the parent restarts a worker that dies and drains all on
SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2

from extproc.server.workers import SUPERVISOR_ENV, Supervisor, die_with_supervisor, worker_argv
from extproc.stack import free_port, grpc_health_status, wait_until
from tests.conftest import ENDPOINTS


def test_worker_argv_drops_workers_and_adds_the_index():
    argv = ["--log-format", "json", "serve", "--workers", "2", "--port", "1", "--workers=3"]
    assert worker_argv(argv, 1) == [
        *(sys.executable, "-m", "extproc", "--log-format", "json", "serve", "--port", "1"),
        *("--worker-index", "1"),
    ]


async def test_grpc_servers_share_a_port_by_default():
    """grpc sets SO_REUSEPORT on Linux (`grpc.so_reuseport` defaults to 1): what lets N
    worker processes bind the same ext_proc and health ports."""
    port = free_port()
    servers = [grpc.aio.server() for _ in range(2)]
    try:
        assert [s.add_insecure_port(f"127.0.0.1:{port}") for s in servers] == [port, port]
    finally:
        for s in servers:
            await s.stop(0)


# A worker that drains on SIGTERM. It touches `<dir>/<pid>` once its handler is installed:
# a SIGTERM before that kills it with -15, and on a loaded machine Python can take well over
# a second to get there.
SLEEPER = (
    "import os, pathlib, signal, sys, time; "
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
    "pathlib.Path(sys.argv[1], str(os.getpid())).touch(); time.sleep(60)"
)


def test_supervisor_restarts_a_dead_worker_and_forwards_sigterm(tmp_path):
    sup = Supervisor(lambda i: [sys.executable, "-c", SLEEPER, str(tmp_path)], 2, grace_s=1.0)

    def handlers_installed() -> bool:
        pids = sup.pids
        return all(p is not None and (tmp_path / str(p)).exists() for p in pids)

    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(sup.run()))
    t.start()
    try:
        wait_until(handlers_installed, timeout_s=30, what="workers")
        first = sup.pids[0]
        assert first is not None
        psutil.Process(first).kill()
        wait_until(lambda: sup.pids[0] not in (None, first), timeout_s=10, what="restarted worker")
        assert sup.restarts == 1
        wait_until(handlers_installed, timeout_s=30, what="restarted worker's handler")
        pids = [p for p in sup.pids if p is not None]
    finally:
        sup.stop()
        t.join(timeout=15)
    assert result == [0]
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


# A worker that asks to die with its supervisor, then records the SIGTERM that brings.
ORPHAN = (
    "import pathlib, signal, sys, time; "
    "from extproc.server.workers import die_with_supervisor; "
    "assert die_with_supervisor(); d = pathlib.Path(sys.argv[1]); "
    "signal.signal(signal.SIGTERM, lambda *_: ((d / 'terminated').touch(), sys.exit(0))); "
    "(d / 'ready').touch(); time.sleep(60)"
)
SUPERVISOR = (
    "import sys; from extproc.server.workers import Supervisor; "
    "Supervisor(lambda i: [sys.executable, '-c', sys.argv[1], sys.argv[2]], 1, grace_s=1.0).run()"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_drains_when_its_supervisor_is_killed(tmp_path):
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, ORPHAN, str(tmp_path)])
    try:
        wait_until(lambda: (tmp_path / "ready").exists(), timeout_s=30, what="worker", proc=sup)
        sup.kill()
        sup.wait(timeout=10)
        wait_until(
            lambda: (tmp_path / "terminated").exists(), timeout_s=10, what="worker's SIGTERM"
        )
    finally:
        if sup.poll() is None:
            sup.kill()


def test_a_worker_whose_supervisor_is_already_gone_exits():
    assert die_with_supervisor({SUPERVISOR_ENV: str(os.getppid())})
    assert not die_with_supervisor({SUPERVISOR_ENV: "1" if os.getppid() != 1 else "2"})
    assert die_with_supervisor({})  # not a supervised worker: nothing to do


@pytest.fixture
def served() -> Iterator[tuple[subprocess.Popen[bytes], int, int, int]]:
    port, health, admin = free_port(), free_port(), free_port()
    while admin + 1 in (port, health):
        admin = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "extproc", "serve", "--plaintext", "--workers", "2"),
            *("--endpoints", ",".join(ENDPOINTS), "--host", "127.0.0.1"),
            *("--port", str(port), "--health-port", str(health), "--admin-port", str(admin)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc, port, health, admin
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def admin_up(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).status_code == 200


def test_two_workers_share_ports_restart_and_drain(served):
    proc, port, health, admin = served
    for a in (admin, admin + 1):  # worker i serves admin on admin-port + i
        wait_until(lambda a=a: admin_up(a), timeout_s=30, what=f"admin {a}", proc=proc)
    workers = psutil.Process(proc.pid).children()
    assert len(workers) == 2
    listening = {
        c.pid
        for c in psutil.net_connections("tcp")
        if c.status == "LISTEN" and c.laddr.port == port
    }
    assert listening == {w.pid for w in workers}  # both bound the ext_proc port
    serving = health_pb2.HealthCheckResponse.SERVING
    assert grpc_health_status(health, "readiness") == serving

    workers[0].kill()
    wait_until(
        lambda: (
            len(psutil.Process(proc.pid).children()) == 2
            and workers[0].pid not in {c.pid for c in psutil.Process(proc.pid).children()}
        ),
        timeout_s=30,  # generous: the test machine is shared and often loaded
        what="worker restarted",
    )
    for a in (admin, admin + 1):
        wait_until(lambda a=a: admin_up(a), timeout_s=30, what=f"admin {a} after restart")

    survivors = psutil.Process(proc.pid).children()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=40) == 0
    assert not any(w.is_running() and w.status() != "zombie" for w in survivors)
