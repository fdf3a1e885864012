"""One direction of a remote index's traffic (its lookups, or its writes) while it fails.

Why: the Redis index rode out an outage quietly. Lookups answered degraded behind the
breaker (lookup_health.py) with a warning at its first and third opening, and came back
with no line at all unless a timed-out lookup's late answer happened to close the breaker;
writes logged every retry (one a second for as long as Redis was down) and nothing when
they went through again. An operator could not tell from the log when affinity was lost
and when it returned, nor from /metrics whether it was lost now.

So each direction says once that it started failing (with the error), once that it is back
(how long it was down and what was skipped meanwhile), and shows the state in
`IndexStats.degraded[direction]` (exported as `extproc_index_degraded{direction}`, 1 while
failing) and the outages in `IndexStats.outages[direction]`. The counters of what was
skipped stay the index's own (`lookups_degraded`, `write_errors`, `writes_dropped`).
Event loop only; no I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from extproc.index.base import IndexStats

# The directions, as `IndexStats.degraded` and `outages` key them.
LOOKUPS = "lookups"
WRITES = "writes"
DIRECTIONS = (LOOKUPS, WRITES)


class Spell:
    """The failing spell of one direction: `failing` at each failure, `back` at each
    success; each logs only when the state changes."""

    __slots__ = ("_at_start", "_clock", "_log", "_meanwhile", "_name", "_stats", "since")

    def __init__(
        self,
        name: str,
        stats: IndexStats,
        logger: logging.Logger,
        meanwhile: Callable[[], tuple[int, ...]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`meanwhile`: the direction's counters of skipped work now (their growth over the
        spell is reported at its end)."""
        self._name = name
        self._stats = stats
        self._log = logger
        self._meanwhile = meanwhile
        self._clock = clock
        self.since: float | None = None  # when the spell began; None: not failing
        self._at_start: tuple[int, ...] = ()
        stats.degraded.setdefault(name, 0)
        stats.outages.setdefault(name, 0)

    @property
    def failing_now(self) -> bool:
        return self.since is not None

    def failing(self, exc: BaseException, what_happens: str) -> bool:
        """A failure; True (and one warning naming `exc` and `what_happens` meanwhile) when it
        starts a spell."""
        if self.since is not None:
            return False
        self.since = self._clock()
        self._at_start = self._meanwhile()
        self._stats.degraded[self._name] = 1
        self._stats.outages[self._name] += 1
        self._log.warning("kv index: %s failing (%r); %s", self._name, exc, what_happens)
        return True

    def back(self, skipped: Callable[[tuple[int, ...]], str]) -> float | None:
        """A success: when it ends a spell, one info line (how long, and `skipped(growth)`,
        the growth of the `meanwhile` counters put in words) and the spell's seconds."""
        if self.since is None:
            return None
        seconds = self._clock() - self.since
        grown = tuple(b - a for a, b in zip(self._at_start, self._meanwhile(), strict=True))
        self.since = None
        self._stats.degraded[self._name] = 0
        self._log.info(
            "kv index: %s resume after %.1f s down (%s)", self._name, seconds, skipped(grown)
        )
        return seconds
