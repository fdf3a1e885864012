"""Exponential backoff, capped, with optional jitter: the delay every retry loop of the picker
waits after consecutive failures (Kubernetes watches, shared in-flight exchanges, worker
restarts, ...). Pure arithmetic: callers keep their own failure count, clock and random source
(tests pass a fixed one)."""

from __future__ import annotations

# 2**62 * any sane base is far past any cap; the bound only keeps the power finite.
_MAX_DOUBLINGS = 62


def backoff_s(failures: int, base_s: float, cap_s: float, rand: float | None = None) -> float:
    """Seconds to wait after `failures` consecutive failures (1 = the first): `base_s` doubled
    per further failure, at most `cap_s`. With `rand` (a draw in [0, 1)) the delay is scaled
    into [0.5, 1] of that, so replicas that failed together do not retry in step. No failure,
    no wait."""
    if failures <= 0:
        return 0.0
    delay = min(cap_s, base_s * 2 ** min(failures - 1, _MAX_DOUBLINGS))
    return delay if rand is None else delay * (0.5 + 0.5 * rand)
