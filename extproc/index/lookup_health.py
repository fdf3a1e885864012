"""Lookup health: how long a remote index lookup is waited for, and when lookups stop being
tried at all (the breaker).

Why it adapts (bench/RESULTS.md, issue 14, eighth session): on a loaded 2-core machine a
healthy Redis lookup's p90 is 4-6 ms, next to a fixed 5 ms budget, so lookups timed out in
runs; three timeouts in a row opened the breaker for 0.4-1 s, and every lookup of that
replica was answered degraded (routed blind) while Redis was up and answering. Now:

- The budget is `factor` x the p90 of recent answered lookups (late answers included: they
  are the latency this process really sees), never below the configured `floor_s` nor above
  `cap_s`. A request may ask for more (`budget(requested)`, e.g. its prefill time).
- A timed-out lookup is left to finish in the background; its answer counts as a sample and,
  when it came within `cap_s`, as proof Redis is alive. Timeouts open the breaker only when
  `unanswered` of them in a row are still without such an answer `dead_after_s` after the
  first: a stalled Redis (or one slower than the cap), not a slow one. Errors (refused
  connection, Redis error) open it at once, as before.
Pure bookkeeping, no I/O and no clock of its own beyond `clock`: the index calls it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

SAMPLES = 256  # recent answered lookups the p90 is taken over
_RECOMPUTE_EVERY = 16  # samples between two p90 computations (a sort of SAMPLES floats)


class LookupHealth:
    """Adaptive lookup budget and breaker of one index (see the module docstring)."""

    def __init__(
        self,
        floor_s: float,
        cap_s: float,
        *,
        factor: float = 2.0,
        unanswered: int = 3,
        dead_after_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.floor_s = floor_s
        self.cap_s = max(cap_s, floor_s)
        self._factor = factor
        self._unanswered_limit = unanswered
        self._dead_after_s = dead_after_s
        self._clock = clock
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        self._since_recompute = 0
        self._budget_s = floor_s
        self._unanswered = 0
        self._first_unanswered = 0.0
        self._opens = 0
        self._retry_at = 0.0

    @property
    def budget_s(self) -> float:
        """The current adaptive budget (without a request's own wish)."""
        return self._budget_s

    def budget(self, requested_s: float | None = None) -> float:
        return self._budget_s if requested_s is None else max(self._budget_s, requested_s)

    def is_open(self) -> bool:
        """True while lookups are answered degraded without trying Redis."""
        return self._clock() < self._retry_at

    def answered(self, seconds: float, *, late: bool = False) -> None:
        """A lookup came back with an answer, within its budget or `late` (in the background
        after timing out): Redis is alive. A late answer slower than `cap_s` is a sample but
        no proof of health: a Redis that slow would cost every lookup the whole cap, so its
        timeouts go on counting towards the breaker."""
        self._samples.append(seconds)
        if not late or seconds <= self.cap_s:
            self._unanswered = 0
            self._opens = 0
            self._retry_at = 0.0  # a late answer while open is the probe succeeding
        self._since_recompute += 1
        # A late answer is news (the budget is too short now): taken into account at once.
        if late or self._since_recompute >= _RECOMPUTE_EVERY:
            self._since_recompute = 0
            ordered = sorted(self._samples)
            p90 = ordered[int(0.9 * (len(ordered) - 1))]
            self._budget_s = min(self.cap_s, max(self.floor_s, self._factor * p90))

    def timed_out(self) -> float | None:
        """A lookup ran out of budget (it goes on in the background). The backoff in seconds
        when this opens the breaker, else None."""
        now = self._clock()
        if self._unanswered == 0:
            self._first_unanswered = now
        self._unanswered += 1
        if (
            self._unanswered >= self._unanswered_limit
            and now - self._first_unanswered >= self._dead_after_s
        ):
            return self._open(now)
        return None

    def failed(self) -> float:
        """A lookup failed with an error: the breaker opens at once; returns the backoff."""
        return self._open(self._clock())

    def _open(self, now: float) -> float:
        self._opens += 1
        backoff = min(1.0, 0.05 * 2 ** min(self._opens, 5))
        self._retry_at = now + backoff
        return backoff

    @property
    def opens(self) -> int:
        """Times the breaker opened since the last answer (1 = this outage just began)."""
        return self._opens
