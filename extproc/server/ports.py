"""Port checks before start-up: every port the picker will serve is tried first, so a conflict
(a second picker on the same host, a stale process) is one clear error before any port opens,
never a traceback after the ext_proc port was already accepting streams."""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping


class PortInUse(Exception):
    """A port the picker needs is taken (or cannot be bound)."""

    def __init__(self, name: str, host: str, port: int, reason: str) -> None:
        super().__init__(f"{name} port {host}:{port} cannot be bound: {reason}")
        self.name, self.host, self.port = name, host, port


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_ports(host: str, ports: Mapping[str, int]) -> None:
    """Bind (without listening) each named port; raise PortInUse for the first that fails.
    Port 0 (any free port) always succeeds and is skipped. SO_REUSEADDR as the servers set
    it: a port in TIME_WAIT is free, a port someone listens on is not."""
    for name, port in ports.items():
        if not port:
            continue
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
                raise PortInUse(name, host, port, reason or str(exc)) from None


def bind_grpc(name: str, address: str, add_port, *args) -> int:
    """gRPC's add_*_port (which binds), with a bind failure (RuntimeError) as PortInUse."""
    try:
        return add_port(address, *args)
    except RuntimeError as exc:
        host, _, port = address.rpartition(":")
        raise PortInUse(name, host, int(port), str(exc)) from None


def bind_worker_port(server, cfg, creds=None) -> int:
    """This process's own ext_proc port beside the shared one (`server.worker_port`): the same
    service and transport security, on a port no sibling worker shares, so a proxy that lists
    every worker's port balances streams over processes (SO_REUSEPORT balances connections
    only, and Envoy multiplexes all of a thread's streams on one connection)."""
    address = f"{cfg.host}:{cfg.worker_port}"
    if creds is None:
        return bind_grpc("worker", address, server.add_insecure_port)
    return bind_grpc("worker", address, server.add_secure_port, creds)
