"""Fixtures shared by every test package."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest

from extproc.config import ServerSettings, Settings
from extproc.endpoints import parse_endpoints
from extproc.server.app import App
from extproc.testing import ExtProcClient
from tests.redis_servers import redis_cluster, redis_server  # noqa: F401 - fixtures for all

# Loopback addresses where nothing listens: pickers under test may scrape their endpoints'
# metrics, and tests never send traffic anywhere but this machine.
ENDPOINTS = ("127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000")


_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _loopback_only(sock: socket.socket, address: object) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
        host = address[0]
        try:
            is_local = ipaddress.ip_address(host).is_loopback
        except ValueError:
            is_local = host == "localhost"
        if not is_local:
            raise OSError(f"test tried to reach {host}: tests talk to this machine only")


@pytest.fixture(autouse=True, scope="session")
def no_traffic_off_this_machine() -> Iterator[None]:
    """Refuse, in this process, any TCP/UDP connection to a non-loopback address: fake
    endpoints in tests must never turn into real traffic (subprocesses are given loopback
    addresses only)."""

    def connect(sock: socket.socket, address: object) -> None:
        _loopback_only(sock, address)
        return _real_connect(sock, address)

    def connect_ex(sock: socket.socket, address: object) -> int:
        _loopback_only(sock, address)
        return _real_connect_ex(sock, address)

    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
    try:
        yield
    finally:
        socket.socket.connect = _real_connect  # type: ignore[method-assign]
        socket.socket.connect_ex = _real_connect_ex  # type: ignore[method-assign]


@pytest.fixture
def settings() -> Settings:
    """Loopback, ephemeral ports; tests replace fields with msgspec.structs.replace."""
    return Settings(
        endpoints=list(ENDPOINTS),
        server=ServerSettings(
            host="127.0.0.1",
            port=0,
            health_port=0,
            admin_port=0,
            grace_s=1.0,
            # A stream left open when a test ends (the gateways' response-body mode) keeps
            # the drain this long at most, not the 300 s production default.
            response_grace_s=1.0,
            drain_delay_s=0,
            # In-process tests talk plaintext gRPC; TLS (the default) has its own tests.
            plaintext=True,
        ),
    )


@pytest.fixture
async def app(settings: Settings) -> AsyncIterator[App]:
    async with App(settings, parse_endpoints(",".join(settings.endpoints))) as running:
        yield running


@pytest.fixture
async def client(app: App) -> AsyncIterator[ExtProcClient]:
    async with ExtProcClient(f"127.0.0.1:{app.port}") as c:
        yield c


def with_server(settings: Settings, **changes: object) -> Settings:
    return msgspec.structs.replace(
        settings, server=msgspec.structs.replace(settings.server, **changes)
    )
