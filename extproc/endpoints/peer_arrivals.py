"""The other replicas' in-flight prefill tokens per endpoint, dated by when this process saw
them arrive, so a replica can tell a peer's work still ahead of a new prefill from work the
engine has done long ago.

Shared in-flight counts (shared_inflight.py) say how many prompt tokens every picker placed on
an endpoint and has not seen end. A request stays counted until its end is logged: prefill,
then decode, the response through the gateway and the access log's flush. Taken whole as the
queue ahead (`predicted-ttft-scorer`'s floor), that time reads as prefill still to do; behind
three replicas on a busy machine requests stay in flight longer, a busy holder looked
deeper than it was and tenants left it for a cold server (bench/RESULTS.md, issue 14, tenth
session). A replica's own placements are in its virtual queue with their times; the peers'
are only totals. Here what the peers placed on an endpoint since the last exchange is an
arrival at that moment, and what ended releases the oldest arrivals first (requests end
roughly in the order they started). The exchange gives the placed tokens exactly from the
peers' cumulative counters (`arrived`); without them (a peer of an older version, which
publishes totals only) the growth of the total stands in: a lower bound, since a release in
the same interval hides as much (4-8% of the peers' tokens at the 50 ms default,
bench/RESULTS.md, issue 14, twelfth session), dating them as the older tokens they replaced.
`pending` is the work a single prefill lane at `tps` would still have from those arrivals:
the largest "tokens arrived since t, minus what the lane could compute since t" over the
arrivals' times, the workload of a work-conserving queue. Arrivals are
seen up to two exchange intervals late, which only makes them look less drained.

The engine has one lane, though, and it also computes this replica's own placements: a lane
serving the peers alone at full speed drained their tokens on a server this replica was
loading too (bench/RESULTS.md, issue 14, eleventh session: the destination's queue read
0.00-0.03 s against 0.06-0.21 s real). So `update` takes this replica's own in-flight tokens
as well, dated the same way (the exchange that published them, from its own placed
tokens), and `pending_shared` runs
one first-come-first-served lane over both: what is left is the youngest work, and the
peers' part of it is what still counts. At one exchange this replica's growth is put ahead
of the peers' (their order inside the interval is unknown; ahead, it delays theirs).

Apart from what is still ahead, `placed` keeps every token the peers placed on an endpoint as
this process saw it arrive, cumulative: what they had the engine compute there, which fills its
cache as this replica's own placements do (predicted TTFT's `writtenPlacements: fleet`).

No Redis here: the exchange loop feeds `update` with the peers' totals. Event-loop use only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

# Arrivals kept per endpoint; past this the two oldest are merged (their tokens kept, dated
# by the younger, which errs towards counting them as still ahead).
_MAX_ARRIVALS = 256
# Endpoints `placed` keeps a count for before it forgets the idle ones (far above any pool).
_MAX_PLACED_ENDPOINTS = 4096


class PeerArrivals:
    """Peers' in-flight tokens per endpoint as dated arrivals (`[seen_at, tokens]`, oldest
    first)."""

    def __init__(self, max_arrivals: int = _MAX_ARRIVALS) -> None:
        self._max = max(2, max_arrivals)
        self._arrivals: dict[str, deque[list[float]]] = {}
        self._totals: dict[str, int] = {}
        # This replica's own in-flight tokens, the same way (`pending_shared` only).
        self._own_arrivals: dict[str, deque[list[float]]] = {}
        self._own_totals: dict[str, int] = {}
        # The peers' arrived tokens per endpoint, cumulative (`placed`).
        self._placed: dict[str, float] = {}

    def update(
        self,
        totals: Mapping[str, int],
        now: float,
        own: Mapping[str, int] | None = None,
        *,
        arrived: Mapping[str, int] | None = None,
        own_arrived: Mapping[str, int] | None = None,
    ) -> None:
        """The peers' in-flight tokens per endpoint as of `now` (endpoints absent: none), and
        this replica's own (`own`; None leaves them as they were). `arrived` / `own_arrived`:
        the tokens placed per endpoint since the last update, when known (absent endpoints:
        none); None dates arrivals by the totals' growth alone."""
        if own is not None:
            self._own_totals = _advance(
                self._own_arrivals, self._own_totals, own, now, self._max, own_arrived
            )
        self._totals = _advance(
            self._arrivals, self._totals, totals, now, self._max, arrived, self._placed
        )
        if len(self._placed) > _MAX_PLACED_ENDPOINTS:
            # Endpoints come and go (pods): forget those with nothing in flight now; a reader
            # taking `placed` as cumulative sees it start again from 0 there.
            self._placed = {a: n for a, n in self._placed.items() if a in self._totals}

    def arrive(self, address: str, tokens: int, at: float) -> None:
        """A peer's placement of `tokens` on `address` seen at `at` between exchanges (pushed
        at decision time, shared_inflight.py): its total grows by as much, so the next
        `update` dates only what came past it and releases what ended, oldest first. Never
        dated before the youngest arrival already there (the queue stays in order)."""
        if tokens <= 0:
            return
        q = self._arrivals.setdefault(address, deque())
        if q and q[-1][0] > at:
            at = q[-1][0]
        q.append([at, float(tokens)])
        if len(q) > self._max:
            first = q.popleft()
            q[0][1] += first[1]
        self._totals[address] = self._totals.get(address, 0) + int(tokens)
        self._placed[address] = self._placed.get(address, 0.0) + float(tokens)

    def clear(self) -> None:
        """The peers' counts were dropped (Redis gone past their TTL)."""
        self._arrivals.clear()
        self._totals.clear()
        # This replica's own counts are exact and local: kept. So is `placed`: what the
        # peers had computed before is in the caches still.

    def placed(self, address: str) -> float:
        """Every token the peers placed on `address` as far as this process has seen them
        arrive (pushed, or in an exchange), cumulative: what they had its engine compute."""
        return self._placed.get(address, 0.0)

    def total(self, address: str) -> int:
        """The peers' in-flight tokens on `address` at the last update."""
        return self._totals.get(address, 0)

    def since(self, address: str, t: float) -> float:
        """Tokens of the peers' arrivals on `address` dated after `t` and not yet released:
        what they placed there since then, as far as this process has seen it (a pushed
        placement at its decision time, one only the exchange brought at that exchange)."""
        q = self._arrivals.get(address)
        if not q:
            return 0.0
        placed = 0.0
        for at, tokens in reversed(q):
            if at <= t:
                break
            placed += tokens
        return placed

    def pending(self, address: str, now: float, tps: float) -> float:
        """Tokens of the peers' arrivals on `address` a lane computing `tps` tokens a second
        since each arrived would not have done by `now`; at most `total(address)`."""
        q = self._arrivals.get(address)
        if not q:
            return 0.0
        ahead = since = 0.0
        for at, tokens in reversed(q):
            since += tokens
            left = since - tps * max(0.0, now - at)
            if left > ahead:
                ahead = left
        return ahead

    def pending_shared(self, address: str, now: float, tps: float) -> float:
        """Tokens of the peers' arrivals on `address` not done by `now` in one lane computing
        `tps` tokens a second over this replica's own arrivals and the peers' in order of
        arrival (own first at one exchange): the lane's backlog is its youngest arrivals,
        and this is the peers' share of it. Without own arrivals, `pending`."""
        peers = self._arrivals.get(address)
        if not peers:
            return 0.0
        own = self._own_arrivals.get(address)
        if not own:
            return self.pending(address, now, tps)
        # (seen_at, own before peers at one time, tokens), oldest first.
        merged = sorted(
            [(at, 0, tokens) for at, tokens in own] + [(at, 1, tokens) for at, tokens in peers]
        )
        backlog = since = 0.0
        for at, _, tokens in reversed(merged):
            since += tokens
            backlog = max(backlog, since - tps * max(0.0, now - at))
        ahead = 0.0
        for _, is_peer, tokens in reversed(merged):
            if backlog <= 0:
                break
            part = min(tokens, backlog)
            backlog -= part
            if is_peer:
                ahead += part
        return ahead


def _advance(
    arrivals: dict[str, deque[list[float]]],
    known: Mapping[str, int],
    totals: Mapping[str, int],
    now: float,
    cap: int,
    arrived: Mapping[str, int] | None = None,
    placed: dict[str, float] | None = None,
) -> dict[str, int]:
    """Brings `arrivals` from the `known` totals to `totals` at `now`: what `arrived` (or,
    without it, the growth) arrives, then what ended releases the oldest first. Returns the
    new totals (positive only). What arrives is added to `placed`, when given."""
    kept = {a: max(0, int(t)) for a, t in totals.items() if t > 0}
    addresses = set(kept) | set(known) | (set(arrived) if arrived is not None else set())
    for address in addresses:
        total, before = kept.get(address, 0), known.get(address, 0)
        came = max(0, int(arrived.get(address, 0))) if arrived is not None else 0
        # Never less than the growth: an arrival the counters missed (a peer without them)
        # still shows as much as the totals say.
        came = max(came, total - before)
        if came > 0:
            if placed is not None:
                placed[address] = placed.get(address, 0.0) + came
            q = arrivals.setdefault(address, deque())
            q.append([now, float(came)])
            if len(q) > cap:
                first = q.popleft()
                q[0][1] += first[1]
        # Appended first: what ended in this interval may be the arrival itself.
        ended = before + came - total
        if ended > 0:
            _release(arrivals.get(address), ended)
    for address in [a for a in arrivals if a not in kept]:
        del arrivals[address]
    return kept


def _release(q: deque[list[float]] | None, tokens: float) -> None:
    while q and tokens > 0:
        head = q[0]
        if head[1] > tokens:
            head[1] -= tokens
            return
        tokens -= head[1]
        q.popleft()
