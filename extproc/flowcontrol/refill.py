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

Why a predicted credit (`flow_control.reserve_refill_credit: predicted`, opt-in; `rate` is
the above): the ends' rate is right on average but ends come in lumps. Traced in the
overload bench (bench/trace_credit.py; bench/RESULTS.md, twenty-second session, 13 runs),
at the lower band's releases the tokens that really ended within the 0.3 s horizon were
1.33-1.80x the credit on the mean, yet less than the credit in 42-57% of them and less than
half of it in 25-34%: the room a lower request was let into came back later than credited
about half the time, and an interactive request arriving then waited for it (19 of 25
picker waits over 0.1 s had less than the credit end within 0.3 s of their clump's start).
A request's end is foreseeable from its own progress: it runs about its output tokens
times a per-token time (the simulator's spread +-5%), so the predicted credit counts the
requests on the server whose predicted end falls within the horizon from now: their start
(placement) plus their counted output times the median per-output-token time of the recent
ends (measured here, from placement to end). On the same traces it credited 655-951 tokens
on the mean against the rate's 847-966, and more than then ended in 13-31% of the releases
it credited, by 62-203 tokens on the mean over all releases against 289-375. A request ending
earlier than predicted (a model stopping before its max_tokens) frees room the credit did
not count: on the safe side. One already past its predicted end is not counted (late: when
it ends is unknown). Until `SPEED_TRUSTED` ends have measured the per-token time the credit
is the ends' rate (logged once, counted: `unpredicted`). With peers, each publishes its
predicted credit over the horizon as its rate (one exchange old), so the peers' part is
their prediction. The per-token time is measured on this replica's own ends only.
Opt-in: against the rate over six pairs (one picker and two replicas, seeds 1-3) it had
goodput +0.016 on the mean and met both targets in 2 runs against 0, but the reserve it
keeps is smaller, so the engines' KV ran fuller and engine KV waits rose (32 against 22).

Why a credit from the decode's start (`reserve_refill_credit: started`; what `auto` is beside
the joint reserve on one picker, flowcontrol/spike_auto.py): predicted
from placement, a request that queued in the engine (for KV, behind others) ends later than
predicted by its queueing, and is credited while it has not even started: 1p seed 2's C at
59.34 s (twenty-second session) had 2,626 tokens on its server predicted to end within 0.3 s
and none did. On the same session's traces, requests that waited >= 0.1 s for the engine's
KV ended a median 0.16-0.31 s after their placement prediction, about the horizon; and the
time from placement to end is a prefill-and-queue part plus a per-token part (0.16-0.30 s +
0.037-0.038 s per output token, least squares), which one per-token ratio folds together, so short
requests were predicted early. The signal for the decode's start: not the response headers
(for a streamed reply they leave the engine before its prefill; a non-streamed reply's come
at its end) nor its body (not sent to ext_proc: `response_body_mode: NONE`), but the
scraped count of the engine's requests before their first token (`EndpointState.prefilling`:
waiting + running less decoding, from the first-token histogram's count and the finished
requests, endpoints/state.py), which the controller reads at each room check (`observe`).
The engine admits in arrival order, so of this replica's requests on the server judged by a
scrape, all but the newest `prefilling` are past their first token: each is marked started
at that scrape's time (its first token came after its placement and the scrape before), and
predicted to end its counted output times the median per-output-token time from that mark
to the end (the last 64 ends whose first token was so bounded within `SCRAPE_GAP_S`). Not
yet started, a
request is not credited (a prefill and its whole output away). The engine's count covers
every replica's requests, so with peers each replica marks fewer of its own than decode (the
safe side: less credited); a request placed within `ARRIVAL_S` of a scrape is not judged by
it (it may not have reached the engine, which then counts it nowhere). A server whose
scrapes carry no first-token count (an engine that does not export it, or not scraped yet)
is credited from placement as `predicted` does: logged per server, counted (`unstarted`).
Until 8 decodes are timed the credit is `predicted`'s.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.core import EndpointState

log = logging.getLogger("extproc.flowcontrol")

WINDOW_S = 3.0  # the ends that measure a server's rate of freeing room
SPEED_KEPT = 64  # recent ends whose per-output-token time predicts the others' ends
SPEED_TRUSTED = 8  # ends measured before the prediction is used (the rate credit until then)
# A request on the books this long is dropped from the prediction (its end was lost).
LIVE_MAX_S = 600.0
# `started`: a request placed this recently may not have reached its engine (not yet in the
# engine's counts); and scrapes this far apart place a first token too loosely to time by.
ARRIVAL_S = 0.05
SCRAPE_GAP_S = 0.2


class _RecentMedian:
    """The median of the last `SPEED_KEPT` samples, None until `SPEED_TRUSTED` were taken;
    sorted again only after a new sample (read at every room check, added at ends)."""

    def __init__(self) -> None:
        self._samples: collections.deque[float] = collections.deque(maxlen=SPEED_KEPT)
        self._median: float | None = None

    def add(self, sample: float) -> None:
        self._samples.append(sample)
        self._median = None

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self) -> Iterator[float]:
        return iter(self._samples)

    def median(self) -> float | None:
        if len(self._samples) < SPEED_TRUSTED:
            return None
        if self._median is None:
            ordered = sorted(self._samples)
            self._median = ordered[len(ordered) // 2]
        return self._median


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

    def placed(self, key: Hashable, address: str, tokens: int, output_tokens: int) -> None:
        """A request (`key`, until `freed` with it) of `tokens` started on `address`; the rate
        credit needs only its end."""

    def freed(self, address: str, tokens: int, key: Hashable = None) -> None:
        """A request of `tokens` (what it took on the server, FlowRequest.room_tokens)
        ended on `address`."""
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

    def observe(self, address: str, state: EndpointState | None) -> None:
        """`address`'s endpoint state as the controller reads it at every room check
        (scraped figures and their age); the rate and placement credits need none of it."""

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


class PredictedRefill(Refill):
    """The credit from each request's predicted end (`reserve_refill_credit: predicted`, see
    the module docstring); the ends' rate until the per-token time is measured. Event loop
    only."""

    def __init__(self, horizon_s: float, clock: Callable[[], float]) -> None:
        super().__init__(horizon_s, clock)
        # Per server, its requests on the books: key -> (start, tokens, output tokens).
        self._live: dict[str, dict[Hashable, tuple[float, int, int]]] = {}
        self._per_token = _RecentMedian()  # start to end, per output token
        self._cache: dict[str, int] = {}  # credits at `_cache_at` (no start or end since)
        self._cache_at = -1.0
        self.unpredicted = 0  # credits from the ends' rate: no per-token time measured yet

    def placed(self, key: Hashable, address: str, tokens: int, output_tokens: int) -> None:
        if not address or tokens <= 0 or output_tokens <= 0:
            return  # no output to time its end by: never credited ahead of its end
        now = self._clock()
        live = self._live.setdefault(address, {})
        live[key] = (now, tokens, output_tokens)
        stale = [k for k, (at, _, _) in live.items() if now - at > LIVE_MAX_S]
        for k in stale:
            del live[k]
        self._cache_at = -1.0

    def freed(self, address: str, tokens: int, key: Hashable = None) -> None:
        super().freed(address, tokens, key)
        started = self._live.get(address, {}).pop(key, None) if key is not None else None
        if started is None:
            return
        self._cache_at = -1.0
        at, _, output = started
        self._per_token.add((self._clock() - at) / output)
        if len(self._per_token) == SPEED_TRUSTED and self.unpredicted:
            log.info(
                "reserve refill credit: per-output-token time measured (%.4f s over %d ends); "
                "credit from predicted ends from now on",
                self.per_token_s(),
                SPEED_TRUSTED,
            )

    def per_token_s(self) -> float | None:
        """The median seconds per output token from start to end of the recent ends (None
        until `SPEED_TRUSTED` ended)."""
        return self._per_token.median()

    def predicted(self, address: str) -> int | None:
        """Tokens of this replica's requests on `address` predicted to end within the
        horizon (None: no per-token time yet)."""
        per_token = self.per_token_s()
        if per_token is None:
            return None
        return self._cached(address, per_token, self._ending_from_placement)

    def _cached(
        self, address: str, per_token: float, ending: Callable[[str, float, float, float], int]
    ) -> int:
        """`ending(address, now, until, per_token)` once per server and moment: read at every
        room check of every band, it changes only with a placement, an end or the clock."""
        now = self._clock()
        if now != self._cache_at:
            self._cache, self._cache_at = {}, now
        known = self._cache.get(address)
        if known is None:
            known = self._cache[address] = ending(address, now, now + self.horizon_s, per_token)
        return known

    def _ending_from_placement(
        self, address: str, now: float, until: float, per_token: float
    ) -> int:
        return sum(
            tokens
            for at, tokens, output in self._live.get(address, {}).values()
            if now < at + output * per_token <= until
        )

    def rate(self, address: str) -> float:
        """This replica's predicted credit on `address` over the horizon, as a rate (what
        the peers add to theirs); the ends' rate until the per-token time is measured."""
        own = self.predicted(address)
        if own is None:
            return super().rate(address)
        return own / self.horizon_s if self.horizon_s else 0.0

    def rates(self) -> dict[str, float]:
        return {
            a: r for a in list(self._live.keys() | self._ends.keys()) if (r := self.rate(a)) > 0
        }

    def credit(self, address: str) -> int:
        if self.per_token_s() is None:
            if not self.unpredicted:
                log.warning(
                    "reserve refill credit: no per-output-token time measured yet (%d of %d "
                    "ends); crediting the recent ends' rate until then",
                    len(self._per_token),
                    SPEED_TRUSTED,
                )
            self.unpredicted += 1
        return super().credit(address)


class StartedRefill(PredictedRefill):
    """The credit from each request's end predicted from its decode's start
    (`reserve_refill_credit: started`; the module docstring's last part): a request counts
    once a scrape of its server shows it past its first token, and is predicted to end its
    counted output times the median per-output-token time of the recent decodes later. A
    server whose scrapes carry no first-token count is credited as `predicted` does (logged,
    counted: `unstarted`). Event loop only."""

    def __init__(self, horizon_s: float, clock: Callable[[], float]) -> None:
        super().__init__(horizon_s, clock)
        # Per server, this replica's requests not yet seen past their first token, in
        # placement order (the engine admits in arrival order): key -> placed at.
        self._before: dict[str, dict[Hashable, float]] = {}
        # Per server, the requests a scrape saw decoding: key -> (the later of its placement
        # and the scrape before, the scrape that saw it): its first token came between.
        self._started: dict[str, dict[Hashable, tuple[float, float]]] = {}
        self._seen: dict[str, float] = {}  # per server, the last scrape read (taken at)
        self._decode = _RecentMedian()  # decode start to end, per output token
        self._blind: set[str] = set()  # servers whose last scrape had no first-token count
        self.unstarted = 0  # credits on such servers (from placement instead)

    def placed(self, key: Hashable, address: str, tokens: int, output_tokens: int) -> None:
        super().placed(key, address, tokens, output_tokens)
        live = self._live.get(address, {})
        before = self._before.setdefault(address, {})
        if key in live:
            before[key] = live[key][0]
        # The parent drops requests on the books too long (their end was lost): so here.
        for k in [k for k in before if k not in live]:
            del before[k]
        started = self._started.get(address, {})
        for k in [k for k in started if k not in live]:
            del started[k]

    def freed(self, address: str, tokens: int, key: Hashable = None) -> None:
        if key is not None:
            self._before.get(address, {}).pop(key, None)
            entry = self._live.get(address, {}).get(key)
            seen = self._started.get(address, {}).pop(key, None)
            if entry is not None and seen is not None and seen[1] - seen[0] <= SCRAPE_GAP_S:
                # Timed only when the scrapes around its first token were close together
                # (the start is then known to within a scrape interval).
                self._decode.add((self._clock() - seen[1]) / entry[2])
                if len(self._decode) == SPEED_TRUSTED:
                    log.info(
                        "reserve refill credit: per-output-token decode time measured "
                        "(%.4f s over %d ends); ends predicted from decode starts from now on",
                        self.decode_per_token_s(),
                        SPEED_TRUSTED,
                    )
        super().freed(address, tokens, key)

    def decode_per_token_s(self) -> float | None:
        """The median seconds per output token from the decode's start (the scrape that
        first saw it past its first token) to the end, over the recent ends (None until
        `SPEED_TRUSTED` were timed)."""
        return self._decode.median()

    def observe(self, address: str, state: EndpointState | None) -> None:
        """Reads `address`'s latest scrape: this replica's requests the engine is past the
        first token of are marked started at the scrape's time."""
        if state is None or state.prefilling is None or state.age_s is None:
            if address not in self._blind:
                self._blind.add(address)
                if state is not None and state.age_s is not None:
                    # Not merely unscraped yet (the scraper says why it has no figures).
                    log.warning(
                        "reserve refill credit: no first-token count scraped from %s; its "
                        "requests' ends are predicted from their placement until there is",
                        address,
                    )
            return
        self._blind.discard(address)
        taken = self._clock() - state.age_s
        last = self._seen.get(address)
        if last is not None and taken <= last:
            return  # read already
        self._seen[address] = taken
        before = self._before.get(address)
        if not before:
            return
        # A request placed just before the scrape may not have reached the engine, which
        # then counts it nowhere: judged only from `ARRIVAL_S` after its placement. The
        # engine's count covers every replica's requests; taking them all as this
        # replica's newest marks fewer started than are (the safe side: less credited).
        judged = [k for k, at in before.items() if at <= taken - ARRIVAL_S]
        started = self._started.setdefault(address, {})
        for k in judged[: max(0, len(judged) - state.prefilling)]:
            # Its first token came after its placement and the scrape before, if any.
            at = before.pop(k)
            started[k] = (at if last is None else max(at, last), taken)
        self._cache_at = -1.0

    def credit(self, address: str) -> int:
        if address in self._blind:
            self.unstarted += 1
        return super().credit(address)

    def predicted(self, address: str) -> int | None:
        per_token = self.decode_per_token_s()
        if per_token is None or address in self._blind:
            return super().predicted(address)  # from placement
        return self._cached(address, per_token, self._ending_from_decode)

    def _ending_from_decode(self, address: str, now: float, until: float, per_token: float) -> int:
        started = self._started.get(address, {})
        known = 0
        for key, (_, tokens, output) in self._live.get(address, {}).items():
            seen = started.get(key)
            # Not yet decoding: at least a prefill and its whole output away.
            if seen is not None and now < seen[1] + output * per_token <= until:
                known += tokens
        return known


# `flow_control.reserve_refill_credit`: how the room a server is about to free is counted.
CREDITS: dict[str, type[Refill]] = {
    "rate": Refill,
    "predicted": PredictedRefill,
    "started": StartedRefill,
}
