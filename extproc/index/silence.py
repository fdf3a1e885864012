"""Precise mode: KV-event publishers that stay connected but say nothing while the picker
keeps placing requests on their endpoints (engine frozen, events off on one replica, a
topic that names another endpoint). Disconnects and sequence gaps are seen by the
subscriber; this silence is not, and the index would quietly stop learning the endpoint.

`SilenceWatch` counts, per endpoint, the picker's placements since the endpoint's last
KV-event message, and learns how many messages the endpoint normally sends per placement.
An endpoint is *silent* once enough placements went unanswered that hearing nothing is
improbable for that rate (`EXPECTED_MESSAGES` expected, none came), and for longer than its
publisher has ever taken to answer a placement lately. Both sides cost O(1): the router calls
`placed`, the subscriber `heard`; `run` checks once per `every_s`.

Fleet-wide judging (replicas sharing a Redis index behind one bound `kv_events.bind`
address, where each publisher feeds whichever replica it reached): a replica alone sees its
own placements and only the publishers connected to it, so an endpoint whose publisher feeds
a peer looks silent here, and one silent from its start is heard by nobody. With `use_fleet`
each endpoint keeps a second tally, the fleet's: every replica's placements (`peers_placed`,
from the shared in-flight exchange) against every replica's messages (`peers_heard`, what the
peers heard, batched once per check by server/shared_silence.py; `take_heard` gives this
replica's share). An endpoint is then silent only when no replica heard it for the fleet's
placements' worth, judged whether or not this replica ever heard it. While the fleet's news
fails (`fleet_ok` False: Redis down) each replica judges from its own tally as without
sharing, and the fleet tallies restart from nothing when the news is back (what was placed
meanwhile was never weighed against the peers' messages).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from extproc.throttle import Throttle

log = logging.getLogger(__name__)

# Messages that would have been expected in the unanswered placements before silence is
# declared. For a stream of messages arriving at random (Poisson) at the learned rate, none
# in 8 expected has probability e^-8 ≈ 3e-4: about one false alarm per 3,000 windows.
EXPECTED_MESSAGES = 8.0
# Messages per placement assumed before any endpoint's rate is measured (vLLM publishes a
# batch at each admission that stores a full block, and more as decoding fills blocks):
# half of one, so the first window is 16 placements.
PRIOR_PER_PLACEMENT = 0.5
# Messages an endpoint must have sent before its own rate is used (else the fleet's).
MEASURED_MESSAGES = 8.0
# Placements over which rates are learned: past this, both counts are halved (recent
# behaviour weighs most; a workload that changes is relearned).
RATE_HORIZON = 1024.0
# Recent answer delays (first unanswered placement -> next message) kept per endpoint; the
# time window is twice the slowest of them.
DELAY_SAMPLES = 32


@dataclass(slots=True)
class _Tally:
    """Placements against messages, as one judge sees them (this replica's, or the fleet's)."""

    pending: int = 0  # placements since the last message
    first_pending: float = 0.0  # when the first of them was made (monotonic)
    messages: float = 0.0  # decayed totals: the endpoint's messages per placement
    placements: float = 0.0
    delays: deque[float] = field(default_factory=lambda: deque(maxlen=DELAY_SAMPLES))
    ever_heard: bool = False


@dataclass(slots=True)
class _Endpoint:
    own: _Tally = field(default_factory=_Tally)
    fleet: _Tally = field(default_factory=_Tally)  # kept only with `use_fleet`
    heard_here: int = 0  # messages heard here since `take_heard` (fleet sharing only)
    silent_since: float | None = None
    periods: int = 0  # silent periods since it joined


@dataclass(frozen=True, slots=True)
class SilentView:
    """One endpoint as the exporter shows it: `silent` now, `periods` of silence since it
    joined, `unanswered` placements since its last message."""

    silent: bool
    periods: int
    unanswered: int


class SilenceWatch:
    """Per-endpoint KV-event silence that contradicts the picker's placements.

    `placed(endpoint)` at each placement (router, hot path) and `heard(endpoint)` at each
    KV-event message (subscriber) are O(1); `check()` (from `run`, every `every_s`) declares
    silence, with one WARNING line per endpoint (throttled to one per `log_every_s`), and
    `heard` ends it with an INFO line. `clock` is monotonic seconds (injected for tests).
    `judge_unheard` False: an endpoint this process never heard is not judged (replicas
    sharing a Redis index behind one bound address: its publisher may feed a peer), unless
    the fleet's tallies judge it (`use_fleet`).
    """

    def __init__(
        self,
        *,
        every_s: float = 1.0,
        log_every_s: float = 60.0,
        judge_unheard: bool = True,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.every_s = every_s
        self._judge_unheard = judge_unheard
        self._clock = clock
        self._sleep = sleep
        self._throttle = Throttle(every_s=log_every_s)
        self._endpoints: dict[str, _Endpoint] = {}
        # Fleet-wide judging (`use_fleet`): whether the fleet's news arrives now, how late
        # the peers' messages can be told here, and what the last check judged by.
        self._fleet_ok: Callable[[], bool] | None = None
        self._fleet_lag_s = 0.0
        self.judging_fleet = False

    def use_fleet(self, ok: Callable[[], bool], *, lag_s: float) -> None:
        """Judge by the fleet's tallies while `ok()` (the peers' placements and messages
        arrive); `lag_s`: how long after a peer heard a message it is told here (its batch
        interval), added to the time floor so a peer's answer in transit is no silence."""
        self._fleet_ok = ok
        self._fleet_lag_s = lag_s

    def _entry(self, endpoint: str) -> _Endpoint:
        e = self._endpoints.get(endpoint)
        if e is None:
            e = self._endpoints[endpoint] = _Endpoint()
        return e

    def placed(self, endpoint: str) -> None:
        e = self._endpoints.get(endpoint) or self._entry(endpoint)
        own = e.own
        if not own.pending:
            own.first_pending = self._clock()
        own.pending += 1
        if self._fleet_ok is not None:
            self._add_pending(e.fleet, 1)

    def peers_placed(self, endpoint: str, n: int) -> None:
        """The peer replicas placed `n` requests on `endpoint` (seen in the in-flight
        exchange): the fleet's tally only."""
        if self._fleet_ok is not None and n > 0:
            self._add_pending(self._entry(endpoint).fleet, n)

    def _add_pending(self, t: _Tally, n: int) -> None:
        if not t.pending:
            t.first_pending = self._clock()
        t.pending += n

    def heard(self, endpoint: str) -> None:
        e = self._endpoints.get(endpoint) or self._entry(endpoint)
        own, fleet = e.own, (e.fleet if self._fleet_ok is not None else None)
        if e.silent_since is None and not own.pending and (fleet is None or not fleet.pending):
            # Nothing unanswered (most messages: an engine sends several per placement).
            own.messages += 1.0
            own.ever_heard = True
            if fleet is not None:
                e.heard_here += 1
                fleet.messages += 1.0
                fleet.ever_heard = True
            return
        silent = e.silent_since is not None
        now = self._clock() if silent or e.own.pending or e.fleet.pending else 0.0
        unanswered = (e.fleet if self.judging_fleet else e.own).pending
        self._answer(e.own, 1, now, silent, "own")
        if self._fleet_ok is not None:
            e.heard_here += 1
            self._answer(e.fleet, 1, now, silent, "fleet")
        if silent:
            self._recovered(endpoint, e, now, unanswered)

    def peers_heard(self, endpoint: str, n: int) -> None:
        """The peer replicas heard `n` messages of `endpoint` (fleet sharing): the fleet's
        tally learns them and the endpoint is not silent."""
        if self._fleet_ok is None or n <= 0:
            return
        e = self._entry(endpoint)
        now = self._clock()
        silent = e.silent_since is not None
        unanswered = e.fleet.pending
        self._answer(e.fleet, n, now, silent, "fleet")
        if silent:
            self._recovered(endpoint, e, now, unanswered)

    def take_heard(self) -> dict[str, int]:
        """Messages heard here per endpoint since the last call (for the peers)."""
        out: dict[str, int] = {}
        for address, e in self._endpoints.items():
            if e.heard_here:
                out[address] = e.heard_here
                e.heard_here = 0
        return out

    def _answer(self, t: _Tally, n: int, now: float, silent: bool, kind: str) -> None:
        t.messages += n
        t.ever_heard = True
        if not t.pending:
            return
        if not silent:
            t.placements += t.pending
            t.delays.append(now - t.first_pending)
        else:
            # What went unanswered past the window was the fault, not the endpoint's normal
            # rate: learn only the window's worth, so a real outage does not slow the next
            # detection (a workload that really sends less still lowers the rate, a window
            # at a time).
            # (The pool rate sums over endpoints: here only, never per message.)
            t.placements += min(t.pending, self._window(t, self._pool_rate(kind))[0])
        if t.placements > RATE_HORIZON:
            t.placements /= 2.0
            t.messages /= 2.0
        t.pending = 0

    def forget(self, endpoint: str) -> None:
        """`endpoint` left the pool."""
        self._endpoints.pop(endpoint, None)

    def view(self, endpoint: str) -> SilentView:
        e = self._endpoints.get(endpoint)
        if e is None:
            return SilentView(False, 0, 0)
        t = e.fleet if self.judging_fleet else e.own
        return SilentView(e.silent_since is not None, e.periods, t.pending)

    def silent(self) -> Iterator[str]:
        """The endpoints silent now."""
        return (a for a, e in self._endpoints.items() if e.silent_since is not None)

    async def run(self) -> None:
        while True:
            await self._sleep(self.every_s)
            self.check()

    def check(self) -> None:
        """Declare silent every endpoint whose unanswered placements passed its window."""
        now = self._clock()
        fleet = self._fleet_ok is not None and self._fleet_ok()
        if self._fleet_ok is not None and not fleet:
            # The fleet's news is not arriving: what is placed meanwhile would count against
            # messages peers hear but cannot tell; the fleet's tallies restart when it is back.
            for e in self._endpoints.values():
                e.fleet.pending = 0
        self.judging_fleet = fleet
        kind = "fleet" if fleet else "own"
        pool = self._pool_rate(kind)
        judge_unheard = fleet or self._judge_unheard
        floor = self.every_s + self._fleet_lag_s if fleet else self.every_s
        for address, e in self._endpoints.items():
            t = e.fleet if fleet else e.own
            if not t.pending or e.silent_since is not None:
                continue
            if not t.ever_heard and not judge_unheard:
                continue
            n, rate = self._window(t, pool)
            waited = now - t.first_pending
            if t.pending < n or waited < max(floor, 2.0 * max(t.delays, default=0.0)):
                continue
            e.silent_since = now
            e.periods += 1
            self._throttle.warn(
                log,
                f"silent {address}",
                "kv events: no message from %s for %d %splacements over %.1f s (it sends "
                "%.2f per placement: %.0f were expected); the index is not learning its "
                "cache and precise routing to it runs on stale blocks",
                address,
                t.pending,
                "fleet-wide " if fleet else "",
                waited,
                rate,
                t.pending * rate,
                extra={"endpoint": address, "fleet": fleet},
            )

    def _pool_rate(self, kind: str) -> float | None:
        """Messages per placement over every endpoint (`kind`: "own" or "fleet" tallies)."""
        tallies = [getattr(e, kind) for e in self._endpoints.values()]
        messages = sum(t.messages for t in tallies)
        placements = sum(t.placements for t in tallies)
        if messages < MEASURED_MESSAGES or placements <= 0:
            return None
        return messages / placements

    def _window(self, t: _Tally, pool: float | None) -> tuple[int, float]:
        """(placements without a message that make it silent, the messages-per-placement
        rate that sized it): the endpoint's own rate once measured, else the pool's, else
        the prior."""
        if t.messages >= MEASURED_MESSAGES and t.placements > 0:
            rate = t.messages / t.placements
        else:
            rate = pool if pool is not None else PRIOR_PER_PLACEMENT
        return max(1, math.ceil(EXPECTED_MESSAGES / rate)), rate

    def _recovered(self, address: str, e: _Endpoint, now: float, unanswered: int) -> None:
        assert e.silent_since is not None
        silent_s = now - e.silent_since
        e.silent_since = None
        suppressed = self._throttle.allow(f"back {address}")
        if suppressed is not None:
            log.info(
                "kv events: %s heard again after %.1f s silent (%d placements unanswered)",
                address,
                silent_s,
                unanswered,
                extra={"endpoint": address, "suppressed_since_last": suppressed},
            )
