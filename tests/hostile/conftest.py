"""A picker running in a background thread, for synchronous (hypothesis) tests that drive it
over real gRPC."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from extproc.config import ServerSettings, Settings
from extproc.endpoints import parse_endpoints
from extproc.server.app import App

ENDPOINTS = ("127.0.0.11:8000", "127.0.0.12:8000")


@dataclass
class ThreadedPicker:
    app: App
    loop: asyncio.AbstractEventLoop

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.app.port}"

    def call(self, fn):
        """Run `fn()` on the picker's loop (for reading its state safely)."""

        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)


@pytest.fixture(scope="module")
def picker() -> Iterator[ThreadedPicker]:
    settings = Settings(
        endpoints=list(ENDPOINTS),
        server=ServerSettings(
            drain_delay_s=0,
            host="127.0.0.1",
            port=0,
            health_port=0,
            admin_port=None,
            grace_s=0.5,
            max_body_bytes=200_000,
        ),
    )
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict = {}

    async def main() -> None:
        async with App(settings, parse_endpoints(",".join(ENDPOINTS))) as app:
            holder["app"] = app
            holder["stop"] = asyncio.Event()
            ready.set()
            await holder["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(20)
    try:
        yield ThreadedPicker(holder["app"], loop)
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(20)
        loop.close()
