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

A late head is a signal too (`slowdown`): still unfinished at a scrape long after its
price, it says its server slowed before any slowed prefill has ended and taught the fit.
Only a head late by half its price and 100 ms counts: timing every prefill from the tally
was tried, and on a loaded 2-core machine the timings (scrape and event-loop jitter of
tens of ms on 0.15-0.6 s prefills) said "twice slower" of servers that had not changed.

Bounds: the queue never holds more placements than the engine reports waiting plus
running (a request that failed before its first token would otherwise stay forever), and
first tokens beyond our placements (other clients' requests) finish nothing of ours.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Placements younger than this at a scrape may not have reached the engine yet: the bound
# by its waiting + running counts spares them. Generous: on a loaded machine a request
# spends well over 50 ms between the decision and the engine (Envoy, the HTTP hop), and
# each one taken for lost popped a real one from the head, so busy servers' queues ran
# short; a request that really failed costs only this much longer in the queue.
_IN_TRANSIT_S = 0.5
# A head must be this late (beyond half its price) to say its server slowed.
_LATE_S = 0.1


@dataclass(slots=True)
class _Placed:
    at: float  # when the picker placed it (monotonic seconds)
    tokens: float  # uncached prompt tokens, as the picker estimates them


class Backlog:
    """One endpoint's unfinished placements, oldest first. Learner loop (`sync`) and hot
    path (`place`, `work_s`) share one event loop; nothing here awaits."""

    __slots__ = ("_count", "_head_since", "_pending", "_synced_at", "_tokens", "trimmed")

    def __init__(self) -> None:
        self._pending: deque[_Placed] = deque()
        self._tokens = 0.0  # sum of pending tokens
        self._count: float | None = None  # the engine's first-token count at the last sync
        self._synced_at: float | None = None
        self._head_since = 0.0  # when the current head's prefill started, at the latest
        self.trimmed = 0  # placements dropped by the waiting + running bound

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

    def sync(self, first_tokens: float, waiting: int, running: int, at: float) -> None:
        """The engine's cumulative first-token count, and its queue, as scraped at `at`."""
        last, self._count = self._count, first_tokens
        previous, self._synced_at = self._synced_at, at
        if last is None or previous is None or first_tokens < last:
            return  # first look, or the engine restarted: nothing to compare yet
        done = int(first_tokens - last)
        if done > 0 and self._pending:
            for _ in range(min(done, len(self._pending))):
                self._pop()
            # The next one started when the last of them ended, between the two scrapes.
            self._head_since = (previous + at) / 2.0
        # Placements older than the scrape that the engine does not hold are lost (failed,
        # cancelled, or others' first tokens finished ours in the count): keep the newest.
        arrived = sum(1 for p in self._pending if p.at <= at - _IN_TRANSIT_S)
        excess = arrived - (waiting + running)
        if excess > 0:
            self.trimmed += excess
            for _ in range(excess):
                self._pop()
            self._head_since = at

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

    def slowdown(self, per_request_s: float, per_token_s: float) -> float:
        """How many times slower than its price the head has been running, as of the last
        scrape that still had it unfinished (1.0: not late). A server slowed by another
        tenant shows here first: its fit learns only when a slowed prefill ends, and every
        request placed meanwhile would be predicted at the old speed. Only a head late by
        half its price and 100 ms counts: the start is known to a scrape interval, and a
        loaded machine's scrape and event-loop jitter are tens of ms."""
        if not self._pending or self._synced_at is None:
            return 1.0
        head = self._pending[0]
        head_s = per_request_s + per_token_s * head.tokens
        elapsed = self._synced_at - max(head.at, self._head_since)
        if head_s <= 0 or elapsed < 1.5 * head_s + _LATE_S:
            return 1.0
        return elapsed / head_s

    def work_s(self, per_request_s: float, per_token_s: float, now: float) -> float:
        """Seconds of prefill still ahead of a request sent now, at the given prices."""
        n = len(self._pending)
        if n == 0:
            return 0.0
        head = self._pending[0]
        total = n * per_request_s + per_token_s * self._tokens
        head_s = per_request_s + per_token_s * head.tokens
        started = max(head.at, self._head_since)
        # A head still running at the last scrape is not credited beyond its price before
        # that scrape: it is late, and the rest waits for it.
        synced = now if self._synced_at is None else self._synced_at
        done = min(max(0.0, now - started), head_s + max(0.0, now - synced))
        return max(0.0, total - done)
