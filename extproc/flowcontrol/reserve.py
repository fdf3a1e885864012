"""The room a lower band leaves free for higher bands (`reserve_for_higher_bands`), sized
from what the higher bands send: the largest of their recent requests, plus the work they
are expected to send while one of those prefills.

Why the second term: a reserve of one large request is used up by the first interactive
request to arrive; the next one, arriving while the first is still prefilling, found no
server with room and waited in the picker until lower work ended on some server (0.2-1.1 s
in bench/bench_overload.py). How much more arrives in that time follows from the band's
token arrival rate (over its last `HISTORY` requests, so a band that went quiet decays on
its own) times the prefill time of the largest request at the fastest server's prefill
speed (the engines' own where scraped, else time to first byte from the access log).
Without a measured speed (neither yet) only the largest requests are kept, and
`rate_unsized` says so.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger("extproc.flowcontrol")

HISTORY = 100  # recent requests per band whose sizes and arrival rate set the reserve


@dataclass(frozen=True, slots=True)
class _Seen:
    at: float
    tokens: int  # prompt + expected output (what the request takes on a server)
    prompt: int  # the part a server prefills


class Reserve:
    """Per band, the recent requests' sizes and arrival times (`note`), and the room a band
    below must leave free for them (`held`)."""

    def __init__(self, count: int, clock: Callable[[], float]) -> None:
        self._count = count
        self._clock = clock
        self._seen: dict[int, collections.deque[_Seen]] = {}
        self._sum: dict[int, int] = {}  # tokens in each band's history (its arrival rate)
        self._largest: dict[int, tuple[int, int]] = {}  # (tokens, prompt) of the largest
        self._largest_any = (0, 0)  # the same over every band
        # Reserve sizings where the arrival-rate term was left out: no prefill speed known.
        self.rate_unsized = 0
        self.last_held = 0  # tokens held at the last sizing (exported as a gauge)

    def note(self, priority: int, tokens: int, output_tokens: int) -> None:
        seen = self._seen.get(priority)
        if seen is None:
            seen = self._seen[priority] = collections.deque(maxlen=HISTORY)
        if len(seen) == HISTORY:
            self._sum[priority] -= seen[0].tokens
        seen.append(_Seen(self._clock(), tokens, max(0, tokens - output_tokens)))
        self._sum[priority] = self._sum.get(priority, 0) + tokens
        self._largest[priority] = self._top(seen)
        self._largest_any = self._top(itertools.chain.from_iterable(self._seen.values()))

    def _top(self, seen: Iterable[_Seen]) -> tuple[int, int]:
        top = heapq.nlargest(self._count, seen, key=lambda s: s.tokens)
        return sum(s.tokens for s in top), max((s.prompt for s in top), default=0)

    def rate(self, priority: int) -> float:
        """Tokens per second the band sent over its history (0 with fewer than two)."""
        seen = self._seen.get(priority)
        if not seen or len(seen) < 2:
            return 0.0
        span = self._clock() - seen[0].at
        # The first request opens the window; the rest arrived within it.
        return (self._sum[priority] - seen[0].tokens) / span if span > 0 else 0.0

    def held(
        self, priority: int, configured: Iterable[int], prefill_tps: float | None
    ) -> tuple[int, int]:
        """(tokens, priority): the room kept for the bands above `priority` and the highest
        such band (whose ceiling it must fit under); (0, priority) when none.

        Per band above: its largest recent requests plus its arrival rate times the
        largest one's prefill time. A band above (configured or seen) whose history is not
        full yet gets at least the room of the largest recent requests of any band: at a
        burst's start lower work arrives first, and reserving only for what the higher
        band had sent (nothing, or one small request) let lower work fill every server
        (`tests/e2e/test_flow_reserve_prior.py`)."""
        best, top = 0, priority
        for p in set(configured) | self._seen.keys():
            if p <= priority:
                continue
            tokens, prompt = self._largest.get(p, (0, 0))
            if prefill_tps:
                tokens += int(self.rate(p) * prompt / prefill_tps)
            elif p in self._seen and len(self._seen[p]) >= 2:
                if not self.rate_unsized:
                    log.warning(
                        "reserve for higher bands: no prefill speed measured yet (from the "
                        "engines' histograms or the access log), so their arrival rate is not "
                        "counted; keeping room for the largest recent requests only"
                    )
                self.rate_unsized += 1
            if len(self._seen.get(p, ())) < HISTORY:
                tokens = max(tokens, self._largest_any[0])
            if tokens:
                best, top = max(best, tokens), max(top, p)
        self.last_held = best
        return best, top
