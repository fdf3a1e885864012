"""The prefill work one endpoint still has to do for this picker, counted against the
engine's own tally of first tokens.

An open-loop lane (each placement pushes the endpoint's "free at" time by its predicted
prefill) drifts: every misprediction stays in it until the endpoint goes idle, which near the
knee it never does, and a server that slowed keeps its old, short queue until then. Here
the queue is closed by the engine: every scrape says how many first tokens it has produced
(`vllm:time_to_first_token_seconds` count, observed at the first token by vLLM and the
simulator alike), and the engine serves prefills first come first served, so the oldest
placements are the ones that finished. What is left is priced at prediction time with the
endpoint's current fit, so a speed change the fit has just learned reprices the whole
queue at once.

The same tally times each of our prefills: the first token that ends one starts the next,
so a prefill's duration is seen within a scrape or two of its end. Against its price this
gives the endpoint's `pace` (1: as fitted, 3: three times slower), a sign that the server's
speed changed long before the histogram fit has enough intervals to follow; a head running
well past its price says so even before it ends. Predictions multiply prices by the pace.

Bounds: the queue never holds more placements than the engine reports waiting plus
running (a request that failed before its first token would otherwise stay forever), and
first tokens beyond our placements (other clients' requests) finish nothing of ours.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Placements younger than this at a scrape may not have reached the engine yet: the bound
# by its waiting + running counts spares them.
_IN_TRANSIT_S = 0.05
# Prefills shorter than this (priced and seen) are not timed: a scrape interval's
# uncertainty would be most of the sample.
_MIN_TIMED_S = 0.25
# A prefill is timed only when the two scrapes around its end are closer than this fraction
# of its duration.
_GAP_FRACTION = 0.5
# Weight of a new timed prefill in the pace, and the pace's bounds: it only ever says
# "slower" (a faster server is the fit's to learn; timing noise is not a speed-up).
_PACE_WEIGHT = 0.5
_PACE_BOUNDS = (1.0, 20.0)
# A head overdue by more than this (and this fraction of its price) shows a slower server.
_LATE_S = 0.1
_LATE_FRACTION = 0.3
# The pace is kept against the price of a prefill of this many tokens.
_REF_TOKENS = 1000.0


@dataclass(slots=True)
class _Placed:
    at: float  # when the picker placed it (monotonic seconds)
    tokens: float  # uncached prompt tokens, as the picker estimates them


class Backlog:
    """One endpoint's unfinished placements, oldest first. Learner loop (`sync`) and hot
    path (`place`, `work_s`) share one event loop; nothing here awaits."""

    __slots__ = ("_basis", "_count", "_head_since", "_pending", "_synced_at", "_tokens", "pace",
                 "timed", "trimmed")  # fmt: skip

    def __init__(self) -> None:
        self._pending: deque[_Placed] = deque()
        self._tokens = 0.0  # sum of pending tokens
        self._count: float | None = None  # the engine's first-token count at the last sync
        self._synced_at: float | None = None
        self._head_since = 0.0  # when the current head's prefill started, at the latest
        self.trimmed = 0  # placements dropped by the waiting + running bound
        self.pace = 1.0  # seen / priced prefill time of our recent timed prefills
        self._basis = 0.0  # price of a _REF_TOKENS prefill when the pace was last sampled
        self.timed = 0  # prefills timed

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def tokens(self) -> float:
        return self._tokens

    def place(self, tokens: float, now: float) -> None:
        if not self._pending:
            self._head_since = now
        self._pending.append(_Placed(now, tokens))
        self._tokens += tokens

    def sync(
        self,
        first_tokens: float,
        waiting: int,
        running: int,
        at: float,
        prices: tuple[float, float] | None = None,
    ) -> None:
        """The engine's cumulative first-token count, and its queue, as scraped at `at`;
        `prices` (seconds per request, per token) time our prefills against the fit."""
        last, self._count = self._count, first_tokens
        previous, self._synced_at = self._synced_at, at
        if last is None or previous is None or first_tokens < last:
            return  # first look, or the engine restarted: nothing to compare yet
        done = int(first_tokens - last)
        if done > 0 and self._pending:
            ended = (previous + at) / 2.0  # somewhere between the two scrapes
            head = self._pending[0]
            seen = ended - max(head.at, self._head_since)
            # Timed only when the scrapes were close enough to say when it ended.
            if done == 1 and prices is not None and at - previous <= _GAP_FRACTION * seen:
                self._time(seen, head.tokens, prices)
            for _ in range(min(done, len(self._pending))):
                self._pop()
            self._head_since = ended  # the next one started when the last of them ended
        # Placements older than the scrape that the engine does not hold are lost (failed,
        # cancelled, or others' first tokens finished ours in the count): keep the newest.
        arrived = sum(1 for p in self._pending if p.at <= at - _IN_TRANSIT_S)
        excess = arrived - (waiting + running)
        if excess > 0:
            self.trimmed += excess
            for _ in range(excess):
                self._pop()
            self._head_since = at

    def _time(self, seen_s: float, tokens: float, prices: tuple[float, float]) -> None:
        priced = prices[0] + prices[1] * tokens
        pace = self._pace(prices)
        if priced <= 0.0 or max(seen_s, priced * pace) < _MIN_TIMED_S:
            return
        sample = min(_PACE_BOUNDS[1], max(_PACE_BOUNDS[0], seen_s / priced))
        self.pace = pace + _PACE_WEIGHT * (sample - pace)
        self._basis = prices[0] + prices[1] * _REF_TOKENS
        self.timed += 1

    def _pace(self, prices: tuple[float, float]) -> float:
        """The pace against `prices`: it was measured against the prices of its last sample,
        and a fit that has since learned the change (prices x3) leaves less of it (pace / 3)."""
        ref = prices[0] + prices[1] * _REF_TOKENS
        if self._basis <= 0.0 or ref <= 0.0:
            return self.pace
        return min(_PACE_BOUNDS[1], max(_PACE_BOUNDS[0], self.pace * self._basis / ref))

    def _pop(self) -> None:
        p = self._pending.popleft()
        self._tokens -= p.tokens
        if not self._pending:
            self._tokens = 0.0  # no drift from float sums

    def ours_waiting(self) -> int:
        """Our placements the engine may count as waiting. Counted generously (the head too:
        the scrape may predate its start), so a request of ours is never taken for someone
        else's."""
        return len(self._pending)

    def work_s(self, per_request_s: float, per_token_s: float, now: float) -> tuple[float, float]:
        """(seconds of prefill still ahead of a request sent now, the pace to price that
        request's own prefill at), at the given prices."""
        n = len(self._pending)
        if n == 0:
            return 0.0, self._pace((per_request_s, per_token_s))
        pace = self._pace((per_request_s, per_token_s))
        head = self._pending[0]
        head_s = (per_request_s + per_token_s * head.tokens) * pace
        started = max(head.at, self._head_since)
        # A head still running at the last scrape well past its price is late: the server
        # is slower than priced, by at least that much, for it and everything behind it.
        ran = (started if self._synced_at is None else self._synced_at) - started
        if ran > head_s * (1.0 + _LATE_FRACTION) + _LATE_S and head_s > 0.0:
            pace *= ran / head_s
            head_s = ran
        total = (n * per_request_s + per_token_s * self._tokens) * pace
        # The head is not credited beyond its price before the last scrape.
        synced = now if self._synced_at is None else self._synced_at
        done = min(max(0.0, now - started), head_s + max(0.0, now - synced))
        return max(0.0, total - done), pace
