"""Rate-limited logging for things hostile peers can repeat at will (malformed messages,
refused peers, spoofed events) and for our own bugs met once per request under a fault:
one line per reason per interval, never one per attempt."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Throttle:
    """At most one log line per `every_s` per key; counts what it suppressed in between so
    the next line says how many there were."""

    every_s: float = 10.0
    _last: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def allow(self, key: str) -> int | None:
        """None: stay quiet. Else: log now; the value is how many were suppressed before."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        if len(self._last) > 1024:  # keys are few (reasons); never let them grow unbounded
            self._last.clear()
            self._suppressed.clear()
        self._last[key] = now
        return self._suppressed.pop(key, 0)

    def warn(
        self,
        logger: logging.Logger,
        key: str,
        msg: str,
        *args: object,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """`logger.warning(msg, *args)` unless `key` was said within `every_s`; the line's
        `suppressed_since_last` says how many were left out before it."""
        self._say(logger.warning, key, msg, args, extra)

    def exception(
        self,
        logger: logging.Logger,
        key: str,
        msg: str,
        *args: object,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """`logger.exception(msg, *args)` (ERROR, with the traceback being handled) unless
        `key` was said within `every_s`; `suppressed_since_last` as in `warn`."""
        self._say(logger.exception, key, msg, args, extra)

    def _say(
        self,
        emit: Callable[..., None],
        key: str,
        msg: str,
        args: tuple[object, ...],
        extra: dict[str, Any] | None,
    ) -> None:
        suppressed = self.allow(key)
        if suppressed is not None:
            emit(msg, *args, extra={**(extra or {}), "suppressed_since_last": suppressed})
