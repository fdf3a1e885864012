"""Room a server is about to free, counted toward the reserve a lower band leaves there for
higher bands (`flow_control.reserve_refill_s`, opt-in; 0 = off).

Why: the reserve (flowcontrol/reserve.py) keeps room for the higher band's largest recent
request plus what it sends while that one prefills, free on one server at every moment. In
the overload bench that room was 11.6-11.7% of the fleet's KV, kept idle through the steady
phase, and the holder was below it 44-57% of the time (interactive work had just taken part
of it): then lower work may go nowhere until one server has the whole reserve again, and
what frees on the other servers meanwhile idles too (2.0-2.7% more; bench/RESULTS.md,
fourteenth session, bench/overload_idle.py). Yet a server under load frees room all the
time, as its requests end: a higher-band request that finds a little less than it needs
waits only until that much has ended there, and strict priority keeps lower work off the
room that frees meanwhile. So the reserve may be short on a server by what it is expected
to free within `reserve_refill_s`: the tokens of the requests that ended there over the
last `WINDOW_S`, per second, times that horizon. A higher-band request as large as the
reserve then waits at most about the horizon for room, at the worst moment; smaller ones
not at all.

Counted from this replica's own placements' ends (`freed`, at each request's end, when its
in-flight count ends), plus, with replicas sharing flow state (flowcontrol/shared.py), the
rates the peers publish for their own (`peer_rates`, one exchange interval old): each
replica sees only its own ends, and the credit from them alone was its share of the
server's. Redis failing: the peers' rates are dropped (the credit is then from this
replica's own ends: smaller, it holds back more, never less). A server where nothing ended
recently gets no credit (the reserve as before).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

WINDOW_S = 3.0  # the ends that measure a server's rate of freeing room


class Refill:
    """Per server, tokens of the requests that ended there recently (`freed`), and the room
    it is expected to free within the horizon (`credit`). Event loop only."""

    def __init__(self, horizon_s: float, clock: Callable[[], float]) -> None:
        if horizon_s < 0:
            raise ValueError(f"reserve_refill_s {horizon_s} is negative")
        self.horizon_s = horizon_s
        self._clock = clock
        self._ends: dict[str, collections.deque[tuple[float, int]]] = {}
        self._sum: dict[str, int] = {}
        self.last_credit = 0  # the largest credit at the last sizing (exported as a gauge)
        self.peer_rates: dict[str, float] = {}  # address -> tokens/s the peers' requests freed

    def freed(self, address: str, tokens: int) -> None:
        """A request of `tokens` (prompt + expected output) ended on `address`."""
        if not address or tokens <= 0:
            return
        ends = self._ends.setdefault(address, collections.deque())
        ends.append((self._clock(), tokens))
        self._sum[address] = self._sum.get(address, 0) + tokens
        self._prune(address, ends)

    def rate(self, address: str) -> float:
        """Tokens per second this replica's requests freed on `address` lately."""
        ends = self._ends.get(address)
        if not ends:
            return 0.0
        self._prune(address, ends)
        return self._sum.get(address, 0) / WINDOW_S

    def rates(self) -> dict[str, float]:
        """Per server with recent ends, this replica's rate (what it publishes to peers)."""
        return {a: r for a in list(self._ends) if (r := self.rate(a)) > 0}

    def credit(self, address: str) -> int:
        """Tokens `address` is expected to free within the horizon: this replica's requests
        and the peers' (0 when none ended)."""
        rate = self.rate(address) + self.peer_rates.get(address, 0.0)
        return int(rate * self.horizon_s)

    def _prune(self, address: str, ends: collections.deque[tuple[float, int]]) -> None:
        since = self._clock() - WINDOW_S
        while ends and ends[0][0] < since:
            self._sum[address] -= ends.popleft()[1]
        if not ends:
            del self._ends[address]
            del self._sum[address]
