"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest

from extproc.config import ServerSettings, Settings
from extproc.endpoints import parse_endpoints
from extproc.server.app import App
from extproc.testing import ExtProcClient

ENDPOINTS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


@pytest.fixture
def settings() -> Settings:
    """Loopback, ephemeral ports; tests replace fields with msgspec.structs.replace."""
    return Settings(
        endpoints=list(ENDPOINTS),
        server=ServerSettings(host="127.0.0.1", port=0, health_port=0, admin_port=0, grace_s=1.0),
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
