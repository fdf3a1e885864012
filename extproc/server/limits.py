"""Process-wide limits on what open streams may hold: the total of buffered request-body bytes
(the body budget) and how long a stream may take to deliver its body (the body deadline).

Why both: `max_body_bytes` bounds one stream, not their sum, so a few clients that send large
bodies and stop would pin memory until Envoy's idle timeout, which every trickled byte resets.
The budget bounds the sum; the deadline frees what a stalled or trickling client holds. One
event loop owns a budget, so plain integers suffice (no locks).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from extproc.server.metrics import counter, gauge

log = logging.getLogger("extproc.limits")


@dataclass(slots=True)
class BodyBudget:
    """`limit` bytes shared by every stream of the process. A stream reserves each chunk
    before keeping it and gives everything back when its body is done or it ends."""

    limit: int
    used: int = 0
    peak: int = 0
    refused: int = 0
    timed_out: int = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            self.refused += 1
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n

    def collect(self):
        """Metric families for the picker's registry."""
        g = gauge(
            "extproc_request_body_bytes_buffered",
            "Request-body bytes held by all open streams (bounded by server.body_budget_bytes).",
        )
        g.add_metric([], self.used)
        yield g
        c = counter(
            "extproc_request_body_refused",
            "Requests cut because of a body limit (reason: budget = body budget full, "
            "deadline = body not complete within server.body_timeout_s).",
            ["reason"],
        )
        c.add_metric(["budget"], self.refused)
        c.add_metric(["deadline"], self.timed_out)
        yield c


@dataclass(slots=True)
class BodyDeadline:
    """When a stream's body must be complete: `timeout_s` after its request headers."""

    timeout_s: float
    started: float | None = None

    def start(self) -> None:
        self.started = time.monotonic()

    def stop(self) -> None:
        self.started = None

    def remaining(self) -> float | None:
        """Seconds left, or None when no body is being read."""
        if self.started is None:
            return None
        return self.timeout_s - (time.monotonic() - self.started)
