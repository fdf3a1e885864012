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
class _Endpoint:
    pending: int = 0  # placements since the last message
    first_pending: float = 0.0  # when the first of them was made (monotonic)
    messages: float = 0.0  # decayed totals: the endpoint's messages per placement
    placements: float = 0.0
    delays: deque[float] = field(default_factory=lambda: deque(maxlen=DELAY_SAMPLES))
    silent_since: float | None = None
    periods: int = 0  # silent periods since it joined
    ever_heard: bool = False


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
    sharing a Redis index behind one bound address: its publisher may feed a peer).
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

    def placed(self, endpoint: str) -> None:
        e = self._endpoints.get(endpoint)
        if e is None:
            e = self._endpoints[endpoint] = _Endpoint()
        if not e.pending:
            e.first_pending = self._clock()
        e.pending += 1

    def heard(self, endpoint: str) -> None:
        e = self._endpoints.get(endpoint)
        if e is None:
            e = self._endpoints[endpoint] = _Endpoint()
        e.messages += 1.0
        e.ever_heard = True
        if not e.pending:
            return
        now = self._clock()
        if e.silent_since is None:
            e.placements += e.pending
            e.delays.append(now - e.first_pending)
        else:
            # What went unanswered past the window was the fault, not the endpoint's normal
            # rate: learn only the window's worth, so a real outage does not slow the next
            # detection (a workload that really sends less still lowers the rate, a window
            # at a time).
            e.placements += min(e.pending, self._window(e, self._fleet_rate())[0])
            self._recovered(endpoint, e, now)
        if e.placements > RATE_HORIZON:
            e.placements /= 2.0
            e.messages /= 2.0
        e.pending = 0

    def forget(self, endpoint: str) -> None:
        """`endpoint` left the pool."""
        self._endpoints.pop(endpoint, None)

    def view(self, endpoint: str) -> SilentView:
        e = self._endpoints.get(endpoint)
        if e is None:
            return SilentView(False, 0, 0)
        return SilentView(e.silent_since is not None, e.periods, e.pending)

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
        fleet = self._fleet_rate()
        for address, e in self._endpoints.items():
            if not e.pending or e.silent_since is not None:
                continue
            if not e.ever_heard and not self._judge_unheard:
                continue
            n, rate = self._window(e, fleet)
            waited = now - e.first_pending
            if e.pending < n or waited < self._patience(e):
                continue
            e.silent_since = now
            e.periods += 1
            self._throttle.warn(
                log,
                f"silent {address}",
                "kv events: no message from %s for %d placements over %.1f s (it sends "
                "%.2f per placement: %.0f were expected); the index is not learning its "
                "cache and precise routing to it runs on stale blocks",
                address,
                e.pending,
                waited,
                rate,
                e.pending * rate,
                extra={"endpoint": address},
            )

    def _fleet_rate(self) -> float | None:
        messages = sum(e.messages for e in self._endpoints.values())
        placements = sum(e.placements for e in self._endpoints.values())
        if messages < MEASURED_MESSAGES or placements <= 0:
            return None
        return messages / placements

    def _window(self, e: _Endpoint, fleet: float | None) -> tuple[int, float]:
        """(placements without a message that make it silent, the messages-per-placement
        rate that sized it): the endpoint's own rate once measured, else the fleet's, else
        the prior."""
        if e.messages >= MEASURED_MESSAGES and e.placements > 0:
            rate = e.messages / e.placements
        else:
            rate = fleet if fleet is not None else PRIOR_PER_PLACEMENT
        return max(1, math.ceil(EXPECTED_MESSAGES / rate)), rate

    def _patience(self, e: _Endpoint) -> float:
        """Seconds the first unanswered placement must have waited: twice the slowest
        recent answer (an engine whose queue delays its first event is not silent), and at
        least one check interval."""
        slowest = max(e.delays, default=0.0)
        return max(self.every_s, 2.0 * slowest)

    def _recovered(self, address: str, e: _Endpoint, now: float) -> None:
        assert e.silent_since is not None
        silent_s = now - e.silent_since
        e.silent_since = None
        suppressed = self._throttle.allow(f"back {address}")
        if suppressed is not None:
            log.info(
                "kv events: %s heard again after %.1f s silent (%d placements unanswered)",
                address,
                silent_s,
                e.pending,
                extra={"endpoint": address, "suppressed_since_last": suppressed},
            )
