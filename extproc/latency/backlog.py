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

A late head is a signal too (`slowdown`): still unfinished at a scrape after its price, it
says its server slowed before any slowed prefill has ended and taught the fit. It is timed
as a bound, not an estimate: from the *latest* moment it can have started (the scrape that
saw the placement before it finish, or that first saw it on an idle server, and no earlier
than its placement plus the path to the engine) to the last scrape that still saw it
unfinished. Scrape and event-loop jitter can only shorten that span, never lengthen it, so
a head found running longer than its price proves the server is at least that much slower
than the fit, and no margin is needed. (Timing from the earliest possible start, with a
margin of half the price and 100 ms against the jitter, waited 1-2 scrapes too long after
a slowdown and still guessed.)

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


@dataclass(slots=True)
class _Placed:
    at: float  # when the picker placed it (monotonic seconds)
    tokens: float  # uncached prompt tokens, as the picker estimates them


class Backlog:
    """One endpoint's unfinished placements, oldest first. Learner loop (`sync`) and hot
    path (`place`, `work_s`) share one event loop; nothing here awaits."""

    __slots__ = ("_count", "_head_from", "_head_since", "_pending", "_synced_at", "_tokens",
                 "trimmed")  # fmt: skip

    def __init__(self) -> None:
        self._pending: deque[_Placed] = deque()
        self._tokens = 0.0  # sum of pending tokens
        self._count: float | None = None  # the engine's first-token count at the last sync
        self._synced_at: float | None = None
        self._head_since = 0.0  # when the current head's prefill started, best guess
        # The scrape by which the current head had started, at the latest (None: no scrape
        # since it became the head has seen it in the engine).
        self._head_from: float | None = None
        self.trimmed = 0  # placements dropped by the waiting + running bound

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def tokens(self) -> float:
        return self._tokens

    @property
    def head_tokens(self) -> float:
        """The oldest unfinished placement's uncached tokens (0 with none)."""
        return self._pending[0].tokens if self._pending else 0.0

    def place(self, tokens: float, now: float) -> None:
        if not self._pending:
            self._head_since, self._head_from = now, None
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
            # The next one started when the last of them ended, between the two scrapes
            # (best guess, for pricing what is left of it), and by this one (for certain).
            self._head_since, self._head_from = (previous + at) / 2.0, None
        # Placements older than the scrape that the engine does not hold are lost (failed,
        # cancelled, or others' first tokens finished ours in the count): keep the newest.
        arrived = sum(1 for p in self._pending if p.at <= at - _IN_TRANSIT_S)
        excess = arrived - (waiting + running)
        if excess > 0:
            self.trimmed += excess
            for _ in range(excess):
                self._pop()
            self._head_since, self._head_from = at, None
        # The engine holds all of ours: the head (first come, first served) is under way.
        if self._pending and self._head_from is None and waiting + running >= len(self._pending):
            self._head_from = at

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

    def head_elapsed_s(self, transport_s: float = 0.0) -> float:
        """How long the head has run at least, as of the last scrape that still had it
        unfinished: from the latest moment it can have started (see the module docstring;
        `transport_s` is the path from the decision to the engine) to that scrape."""
        if not self._pending or self._synced_at is None or self._head_from is None:
            return 0.0
        start = max(self._head_from, self._pending[0].at + transport_s)
        return max(0.0, self._synced_at - start)

    def slowdown(
        self,
        per_request_s: float,
        per_token_s: float,
        overhead_s: float = 0.0,
        transport_s: float = 0.0,
    ) -> float:
        """How many times slower than its price the head has run at least (1.0: not
        late). A server slowed by another tenant shows here first: its fit learns only when
        a slowed prefill ends, and every request placed meanwhile would be predicted at the
        old speed. The head's first token is at most `overhead_s` past its prefill's end, so
        a head unfinished after `elapsed` has prefilled for at least `elapsed - overhead_s`:
        its speed, `tokens / (elapsed - overhead_s)`, bounds the server's from above."""
        head_s = per_request_s + per_token_s * self.head_tokens
        if head_s <= 0:
            return 1.0
        return max(1.0, (self.head_elapsed_s(transport_s) - overhead_s) / head_s)

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
