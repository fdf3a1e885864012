"""Long-lived loops that talk to Redis: how they wait for a command, how they ride out an
outage, and how they are stopped, once for all of them (shared sessions, shared in-flight
counts, shared flow control, shared request ends, the KV-index writer).

Why a command runs in a task of its own (`command`): redis-py (8.1) turns a CancelledError
that lands while a connection is being set up into a ConnectionError, which its own Retry
then retries on a fresh connection. The cancellation is swallowed: the task carries on with
`cancelling() == 1` and loops, or waits on an Event nobody sets, and whatever awaits it (a
server's stop, pytest's event-loop close) waits forever. A loop that reaches Redis only
through `command` never suspends inside redis-py: a cancel lands in `asyncio.wait`, which
always honours it. The command itself is cancelled and abandoned; it ends by itself within
the client's socket timeouts, or at once when the client is closed.

`Outage` is the one failure/heal/backoff pattern: a degraded flag, one warning when the
feature degrades, one info line when it is back, the caller's counters (metrics) untouched,
and a jittered exponential backoff. `stop` cancels a loop's task and waits a bounded time;
a task that still does not end is abandoned with an error line, never waited on forever.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from extproc.backoff import backoff_s

T = TypeVar("T")

log = logging.getLogger(__name__)


async def command(
    call: Awaitable[T], timeout_s: float, abandoned: set[asyncio.Task[Any]] | None = None
) -> T:
    """The result of one Redis call (or a few, in one coroutine), run in its own task and
    waited for at most `timeout_s` (then TimeoutError). Cancelling the caller cancels and
    abandons the call; the caller's cancellation always goes through. An abandoned call is
    kept in `abandoned` until it ends, so `close` can wait for it."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout_s)
    except asyncio.CancelledError:
        abandon(task, abandoned)
        raise
    if not done:
        abandon(task, abandoned)
        raise TimeoutError(f"no answer from Redis within {timeout_s:.3g} s")
    if task.cancelled():  # only `abandon` cancels it, and never a finished one: belt and braces
        raise TimeoutError("Redis call cancelled")
    return task.result()


def abandon(task: asyncio.Task[Any], abandoned: set[asyncio.Task[Any]] | None) -> None:
    """Cancel a call nobody waits for any more; `close` still waits for it in `abandoned`."""
    task.cancel()
    task.add_done_callback(_retrieve)
    if abandoned is not None:
        abandoned.add(task)
        task.add_done_callback(abandoned.discard)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Done-callback of an abandoned call: consume its outcome (no 'never retrieved')."""
    if not task.cancelled():
        task.exception()


class Outage:
    """The health of one Redis-backed feature, made of one or more `part`s (a publish and a
    read loop, say): degraded while any part's last exchange failed.

    `failed(exc, part)` counts the part's consecutive failures, logs `failed_msg % exc` at
    warning level when the feature turns degraded (once per outage, whichever part fails
    first) and returns how long to back off. `healed(part)` ends the part's failures and,
    when that ends the outage, logs `healed_msg % failures` at info level with how long the
    feature was degraded."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        failed_msg: str,
        healed_msg: str,
        base_s: float = 0.05,
        cap_s: float = 1.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._clock = clock
        self._since = 0.0  # when the outage began
        self._failed_msg = failed_msg
        self._healed_msg = healed_msg
        self._base_s = base_s
        self._cap_s = cap_s
        self._rng = rng or random.Random()
        self._failing: dict[str, int] = {}

    @property
    def degraded(self) -> bool:
        return any(self._failing.values())

    def failures(self, part: str = "") -> int:
        """Consecutive failures of `part` (0: its last exchange went through)."""
        return self._failing.get(part, 0)

    def failed(self, exc: BaseException, part: str = "") -> float:
        if not self.degraded:
            self._since = self._clock()
            self._log.warning(self._failed_msg, exc)
        n = self._failing[part] = self._failing.get(part, 0) + 1
        return backoff_s(n, self._base_s, self._cap_s, self._rng.random())

    def healed(self, part: str = "") -> bool:
        """True when this ended the outage (and said so)."""
        n = self._failing.pop(part, 0)
        if n and not self.degraded:
            self._log.info(self._healed_msg + ", %.1f s degraded", n, self._clock() - self._since)
            return True
        return False


async def stop(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 5.0) -> bool:
    """Cancel background loops (once each) and wait at most `timeout_s` for them to end.
    True when all ended; a task that did not is abandoned with an error line naming it (a
    hang in shutdown is worse than a task left behind). A crash a task ended with is logged,
    not raised."""
    tasks = [t for t in tasks if t is not None]
    for task in tasks:
        task.cancel()
    if not tasks:
        return True
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        log.error(
            "background loop %s did not stop within %.1f s after cancel; abandoned",
            task.get_name(),
            timeout_s,
        )
        task.add_done_callback(_retrieve)
    for task in done:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background loop %s ended with %r", task.get_name(), exc)
    return not pending


async def close(
    client: Any,
    name: str,
    abandoned: set[asyncio.Task[Any]] | None = None,
    timeout_s: float = 5.0,
) -> None:
    """Close a Redis client (or PubSub), waiting at most `timeout_s`: its connections close,
    so an abandoned call's pending read fails at once. The calls in `abandoned` are then
    waited for (bounded): one that swallowed its cancel may have opened a connection after
    the first close, so the client is closed once more after them. Failures are logged."""
    try:
        await command(client.aclose(), timeout_s)
        if abandoned:
            _, pending = await asyncio.wait(set(abandoned), timeout=timeout_s)
            if pending:
                log.warning("%s: %d Redis calls still running at close", name, len(pending))
            await command(client.aclose(), timeout_s)
    except (OSError, TimeoutError, RedisError) as exc:
        log.warning("%s: closing the Redis client failed (%r)", name, exc)
