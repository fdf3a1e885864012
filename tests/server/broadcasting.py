"""Helpers for tests of the features that replicas share over a Redis pub/sub channel
(`redis_broadcast.Broadcast` owners: shared observations, shared placements)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol


class Shared(Protocol):
    async def run(self) -> None: ...
    async def aclose(self) -> None: ...


async def until(pred: Callable[[], Any], what: str) -> None:
    """Waits up to ~5 s for `pred()`; the assertion names `what` never happened."""
    for _ in range(100):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


@contextlib.asynccontextmanager
async def running(*shared: Shared) -> AsyncIterator[None]:
    """The features' loops running for the block's duration, then closed."""
    tasks = [asyncio.create_task(s.run()) for s in shared]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for s in shared:
            await s.aclose()
