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
`rate_unsized` says so, unless the band's prior states its largest request's prefill time
(`prefill_s`), which then prices the rate term.

Why a prior (`BandPrior`, from `flow_control.reserve_prior`): a freshly started picker has
seen nothing of the higher band when a burst starts, and lower work arrives first. Sized
from what it had seen (the largest request of any band, a short one), the reserve was
~1,400 tokens for the first second of the overload bench while batch filled the engines to
0.88-0.97 of their KV, and the first large interactive requests waited 0.7-1.2 s in the
picker. The prior states the band's largest request and arrival rate up front; until the
band has `HISTORY` requests of its own the reserve is the larger of the prior's and the
measured one. Which one a band runs on is logged at each change and exported
(`on_prior`, `history`).

Why a quantile (`flow_control.reserve_quantile`, opt-in): the largest request is the
reserve's size term only because a band's largest is what must fit somewhere; it is also
the rarest. In the overload bench the interactive band's largest (tenant C's, ~2.7k picker
tokens) plus the rate term held 3.5-3.7k tokens free on one server, and that room was
78-96% of the dispatch chances where batch work stayed queued (bench/RESULTS.md, twelfth
session, "where goodput goes"). With a quantile `q` the size term is the `q`-quantile of
the band's recent request sizes (times the count) and the rate term uses the
`q`-quantile prompt: a request above it waits for room like any other. A quantile of a
handful of requests says little, so the history is trusted from `QUANTILE_TRUSTED`
requests on (not `HISTORY`): until then the prior (a largest request) counts as before.

`flow_control.reserve_rate_quantile` (opt-in) changes only the rate term: the work that
arrives while a request prefills is counted over the prefill time of that quantile of
the band's recent prompts (from `QUANTILE_TRUSTED` requests on; before, the largest's or
the prior's), while the size term stays the largest request. The window the rate term
covers is a typical prefill, not the rarest one; the largest request still finds room.
Both are opt-in because both trade the higher band's tail for goodput rather than win
both (bench/RESULTS.md, thirteenth session: q80 +0.05..+0.08 goodput, TTFT p99 3.0x against 1.8x).

Why a spike term (`flow_control.reserve_spike_s`, opt-in): the rate term is the band's mean
arrival rate times a prefill time, but the band's work comes in clumps. In the overload
bench 11 of the 16 interactive requests that waited over 0.1 s in one picker had another
arrive within 0.2 s before them (bench/RESULTS.md, nineteenth session): that one took part
of the reserve, and room came back only as lower work ended. With `reserve_spike_s` the
rate term is instead the `reserve_spike_quantile` (0.9 by default) of the tokens the band
sent within `reserve_spike_s` before each of its recent requests (from `QUANTILE_TRUSTED`
requests on; before, the rate term as above): the room for the largest request plus what,
nine times in ten, arrives close behind another. Like the size term it is the band's last
`HISTORY` requests', so it does not shrink while the band is quiet. Opt-in: it is room
kept idle (0.5 s at 0.9: 1,000-1,900 more tokens on one picker, goodput -0.013..-0.065; 0.3 s
at 0.9: 130-950 more, goodput -0.047..+0.009 on one picker or two replicas, bench/RESULTS.md,
twentieth session).

Why a joint spike (`flow_control.reserve_spike_joint`; `auto`, the default: on for one picker,
flowcontrol/spike_auto.py): the spike term added to the
largest request covers a clump ending in the largest request preceded by the quantile's
clump, which rarely happens together, and the quantile of a sparse count (about half an
arrival per window on the overload bench) sits on a step between request sizes: on one
picker, seeds 4-5 put 44-46 of 100 interactive arrivals within 0.3 s of another against
26-34 on seeds 1-3 and 6, so the 0.9 quantile was a C request (~2.6k tokens) instead of a B
(~1.3k), the reserve kept 0.12-0.15 of the fleet's KV instead of 0.09-0.12, and steady
goodput stayed at 0.87-0.89 in every configuration (bench/RESULTS.md, twenty-third session,
goodput branch). Joint: the quantile is of each recent request's clump, the tokens within
`reserve_spike_s` before it plus its own (the room the request needs if none of what came
before it has freed), and the reserve is that or the largest requests, whichever is more:
it covers that share of the band's requests, not ~98-100% of them. Opt-in: at 0.95 it won
goodput in 6 of 6 pairs (+0.027 mean) and cost the tail as every smaller reserve does
(picker waits over 0.1 s 30 against 15, pooled TTFT p99 2.42x against 2.33x); measured
again at 0.97, with `reserve_refill_credit: started` and on two replicas, goodput was higher
in 8 of 8 pairs and the two replicas' tail worse in both (pooled p99 2.5-2.7x against 1.6x;
bench/RESULTS.md, twenty-fourth session, jointe2e branch). With `started` at 0.95 on one
picker, over seven pairs (twenty-fourth and twenty-fifth sessions): goodput higher in 7 of 7,
the pooled tail not worse (2.27x against 2.36x, 13 above 2x each): the default there.

Why the fleet's arrivals (`peer_arrived`, fed by flowcontrol/shared.py): active-active
replicas each see only their share of the band's arrivals. Sized from its own share, a
replica's spike term was a third to two thirds of the fleet's on the overload bench's
arrivals (0.3-1.9k tokens against 1.2-2.6k at 0.5 s), and each replica let lower work into
room the other replica's share of the band then needed. With the peers' arrivals the term
is the fleet's on every replica (the size and mean-rate terms stay each replica's own).
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger("extproc.flowcontrol")

HISTORY = 100  # recent requests per band whose sizes and arrival rate set the reserve
# With a quantile: the band's own history sizes the reserve from this many requests on.
QUANTILE_TRUSTED = 20
# With a spike window: our own arrivals kept per band for the peers (shared.py publishes
# the recent ones; a band past this many within one publish window is counted short there).
OWN_KEPT = 256
# With a spike window: the most bands whose arrivals are kept (a deployment has a handful of
# priority bands; a peer's entries naming more are refused).
PEER_BANDS = 64


@dataclass(frozen=True, slots=True)
class _Seen:
    at: float
    tokens: int  # prompt + expected output (what the request takes on a server)
    prompt: int  # the part a server prefills


class _Sorted:
    """A band's recent sizes and prompts, each kept in order as requests come and go, so a
    quantile is read by index: before, every noted request sorted the band's history once
    per quantile (and every band's once more)."""

    __slots__ = ("prompts", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.prompts: list[int] = []

    def add(self, seen: _Seen) -> None:
        bisect.insort(self.tokens, seen.tokens)
        bisect.insort(self.prompts, seen.prompt)

    def drop(self, seen: _Seen) -> None:
        del self.tokens[bisect.bisect_left(self.tokens, seen.tokens)]
        del self.prompts[bisect.bisect_left(self.prompts, seen.prompt)]


@dataclass(frozen=True, slots=True)
class BandPrior:
    """What a band is expected to send before its history says: its largest request
    (`tokens`, of which `prompt` is prefilled), its arrival rate (tokens/s) and the largest
    request's prefill time (seconds; the rate term's window until a speed is measured)."""

    tokens: int
    prompt: int
    rate: float = 0.0
    prefill_s: float = 0.0


def _rank(quantile: float, n: int) -> int:
    """Nearest rank: the index of the smallest of `n` sorted values at or above the
    quantile."""
    return max(0, math.ceil(quantile * n) - 1)


class Reserve:
    """Per band, the recent requests' sizes and arrival times (`note`), and the room a band
    below must leave free for them (`held`)."""

    def __init__(
        self,
        count: int,
        clock: Callable[[], float],
        priors: Mapping[int, BandPrior] | None = None,
        quantile: float = 0.0,
        rate_quantile: float = 0.0,
        spike_s: float = 0.0,
        spike_quantile: float = 0.9,
        spike_joint: bool = False,
    ) -> None:
        """`count`: how many of a band's requests the room is for; `quantile`: 0 for the
        largest ones, else in (0, 1): that quantile of the band's recent sizes;
        `rate_quantile`: 0 for the rate term over the size term's prefill time, else over
        that quantile of the recent prompts'; `spike_s`: 0 for the rate term, else the
        `spike_quantile` of the tokens sent within that many seconds before each recent
        request instead (see the module docstring); `spike_joint`: that quantile of each
        request's clump (those tokens plus its own) is the reserve when above the largest
        requests, instead of being added to them."""
        for q in (quantile, rate_quantile):
            if not 0.0 <= q < 1.0:
                raise ValueError(f"reserve quantile {q} not in [0, 1)")
        if spike_s < 0 or not 0.0 < spike_quantile <= 1.0:
            raise ValueError(f"reserve spike {spike_s} s at {spike_quantile} out of range")
        self._spike_s = spike_s
        self._spike_quantile = spike_quantile
        self._spike_joint = spike_joint
        # With a spike window, per band: the arrivals (time, tokens) the spike term is sized
        # from, in time order: ours and, with shared state, the peers' (`peer_arrived`).
        self._arrivals: dict[int, list[tuple[float, int]]] = {}
        self._spike_at: dict[int, int] = {}  # per band: its spike term, until an arrival
        # Per band, our own recent arrivals for the peers: (sequence number, time, tokens).
        self._own: dict[int, collections.deque[tuple[int, float, int]]] = {}
        self._own_seq = itertools.count(1)
        self._rate_quantile = rate_quantile
        self._rate_prompt: dict[int, int] = {}  # per band: its rate_quantile prompt
        self._count = count
        self._quantile = quantile
        # Requests of history from which a band's own history alone sizes its reserve.
        self.trusted_at = QUANTILE_TRUSTED if quantile else HISTORY
        self._clock = clock
        self._priors = dict(priors or {})
        # Per band with a prior: whether its last sizing used it (None: not sized yet).
        self.on_prior: dict[int, bool] = {}
        self._warned_short: set[int] = set()
        # With a spike window: the bands whose reserve counts their spike term (their
        # arrivals reached `QUANTILE_TRUSTED`); before, the mean-rate term stands in, said
        # once per band when the spike term takes over.
        self.spike_on: set[int] = set()
        self._seen: dict[int, collections.deque[_Seen]] = {}
        # With a quantile (either): each band's history in order (quantiles by index).
        self._sorted: dict[int, _Sorted] = {}
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
        ordered = None
        if self._quantile or self._rate_quantile:
            ordered = self._sorted.setdefault(priority, _Sorted())
        now = self._clock()
        if len(seen) == HISTORY:
            self._sum[priority] -= seen[0].tokens
            if ordered is not None:
                ordered.drop(seen[0])
        new = _Seen(now, tokens, max(0, tokens - output_tokens))
        seen.append(new)
        if self._spike_s:
            self._arrived(priority, now, tokens)
            own = self._own.get(priority)
            if own is None:
                own = self._own[priority] = collections.deque(maxlen=OWN_KEPT)
            own.append((next(self._own_seq), now, tokens))
        self._sum[priority] = self._sum.get(priority, 0) + tokens
        if ordered is not None:
            ordered.add(new)
        if self._rate_quantile:
            assert ordered is not None
            prompts = ordered.prompts
            self._rate_prompt[priority] = prompts[_rank(self._rate_quantile, len(prompts))]
        if self._quantile:
            band = self._sorted[priority]
            self._largest[priority] = self._at_quantile(band.tokens, band.prompts)
            # Every band's together: one merge of the ordered lists, no sort.
            every = self._sorted.values()
            self._largest_any = self._at_quantile(
                list(heapq.merge(*(b.tokens for b in every))),
                list(heapq.merge(*(b.prompts for b in every))),
            )
        else:
            self._largest[priority] = self._top(seen)
            self._largest_any = self._top(itertools.chain.from_iterable(self._seen.values()))

    def _at_quantile(self, tokens: list[int], prompts: list[int]) -> tuple[int, int]:
        """(count x the quantile size, the quantile prompt) of sorted sizes and prompts."""
        if not tokens:
            return 0, 0
        rank = _rank(self._quantile, len(tokens))
        return self._count * tokens[rank], prompts[rank]

    def _top(self, seen: Iterable[_Seen]) -> tuple[int, int]:
        """The largest `count` requests: their tokens together, the largest prompt of them."""
        top = heapq.nlargest(self._count, seen, key=lambda s: s.tokens)
        return sum(s.tokens for s in top), max((s.prompt for s in top), default=0)

    def bands(self) -> list[int]:
        """The bands seen or given a prior, in order."""
        return sorted(self._seen.keys() | self._priors.keys())

    def history(self, priority: int) -> int:
        """Requests of the band's own history (the reserve trusts it alone at
        `trusted_at`: `HISTORY`, or `QUANTILE_TRUSTED` with a quantile)."""
        return len(self._seen.get(priority, ()))

    def spike(self, priority: int) -> int:
        """The `spike_quantile` of the tokens the band sent within `spike_s` before each of
        its last `HISTORY` arrivals, the peers' included (0 without a spike window or
        history); with `spike_joint`, each arrival's own tokens counted with them."""
        known = self._spike_at.get(priority)
        if known is not None:
            return known
        arrivals = self._arrivals.get(priority)
        if not arrivals:
            return 0
        aheads = []
        start = max(0, len(arrivals) - HISTORY)
        lo, inside = 0, 0  # the window before arrival i holds arrivals lo..i-1: `inside` tokens
        for i, (at, tokens) in enumerate(arrivals):
            while lo < i and at - arrivals[lo][0] >= self._spike_s:
                inside -= arrivals[lo][1]
                lo += 1
            if i >= start:
                aheads.append(inside + tokens if self._spike_joint else inside)
            inside += tokens
        aheads.sort()
        known = self._spike_at[priority] = aheads[_rank(self._spike_quantile, len(aheads))]
        return known

    @property
    def spike_s(self) -> float:
        return self._spike_s

    def now(self) -> float:
        """The reserve's clock (the controller's): arrival times are on it."""
        return self._clock()

    def spike_history(self, priority: int) -> int:
        """Arrivals the spike term is sized from (the fleet's, with peers), up to `HISTORY`."""
        return min(HISTORY, len(self._arrivals.get(priority, ())))

    def peer_arrived(self, priority: int, at: float, tokens: int) -> bool:
        """A peer replica's request of the band arrived at `at` (our clock): the band's
        spike term counts it as its own (with a spike window; else ignored). False (not
        taken) for a band new here past `PEER_BANDS` bands: each band keeps its arrivals,
        and a peer's word must not grow that without bound."""
        if not self._spike_s:
            return True
        if priority not in self._arrivals and len(self._arrivals) >= PEER_BANDS:
            return False
        self._arrived(priority, at, tokens)
        return True

    def own_arrivals(
        self, since: float, above: int
    ) -> tuple[list[tuple[int, int, float, int]], bool]:
        """Our own arrivals of the bands above `above` at or after `since`: (sequence
        number, band, time, tokens) each, and whether some band had more than `OWN_KEPT`
        since then (its oldest are missing); for the peers' spike terms."""
        out: list[tuple[int, int, float, int]] = []
        short = False
        for band, own in self._own.items():
            if band <= above:
                continue
            for seq, at, tokens in reversed(own):
                if at < since:
                    break
                out.append((seq, band, at, tokens))
            else:
                short = short or len(own) == OWN_KEPT
        out.sort()
        return out, short

    def _arrived(self, priority: int, at: float, tokens: int) -> None:
        arrivals = self._arrivals.setdefault(priority, [])
        if not arrivals or at >= arrivals[-1][0]:
            arrivals.append((at, tokens))
        else:  # a peer's, heard one exchange late
            bisect.insort(arrivals, (at, tokens))
        # Every kept arrival's window needs the arrivals up to `spike_s` before it; past
        # twice the history the oldest are dropped (a window holding more than `HISTORY`
        # arrivals is counted short, and is far above any reserve then anyway).
        if len(arrivals) > 2 * HISTORY:
            del arrivals[: len(arrivals) - 2 * HISTORY]
        self._spike_at.pop(priority, None)

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
        largest one's prefill time. Until a band above (configured, with a prior, or seen)
        has a full history, its configured prior counts as well (the larger request, the
        larger rate), and without a prior it gets at least the room of the largest recent
        requests of any band: at a burst's start lower work arrives first, and reserving
        only for what the higher band had sent (nothing, or one small request) let lower
        work fill every server (`tests/e2e/test_flow_reserve_prior.py`)."""
        best, top, above = 0, priority, False
        for p in set(configured) | self._seen.keys() | self._priors.keys():
            if p <= priority:
                continue
            above = True
            tokens, prompt = self._largest.get(p, (0, 0))
            rate = self.rate(p)
            short = self.history(p) < self.trusted_at
            prior = self._priors.get(p)
            if prior is not None:
                self._source(p, short)
                if short:
                    tokens = max(tokens, self._count * prior.tokens)
                    prompt = max(prompt, prior.prompt)
                    rate = max(rate, prior.rate)
            elif short and p not in self._warned_short:
                self._warned_short.add(p)
                log.warning(
                    "reserve for higher bands: band %d has no reserve_prior and %d of %d "
                    "requests of history; keeping room for the largest recent request of "
                    "any band until it has them",
                    p,
                    self.history(p),
                    self.trusted_at,
                )
            if self._rate_quantile and self.history(p) >= QUANTILE_TRUSTED:
                prompt = self._rate_prompt[p]
            if self._spike_s and self.spike_history(p) >= QUANTILE_TRUSTED:
                if p not in self.spike_on:
                    self.spike_on.add(p)
                    log.info(
                        "reserve for band %d now sized by its spike term (%d arrivals within "
                        "%.2f s, the fleet's); before, by its mean arrival rate",
                        p,
                        self.spike_history(p),
                        self._spike_s,
                    )
                # The band's own clumps (`reserve_spike_s`) instead of its mean rate; joint:
                # the clump a request ends is the room it needs, the largest at the least.
                if self._spike_joint:
                    tokens = max(tokens, self.spike(p))
                else:
                    tokens += self.spike(p)
            elif prefill_tps:
                tokens += int(rate * prompt / prefill_tps)
            elif rate and short and prior is not None and prior.prefill_s:
                # No speed measured yet (a fresh picker: the first seconds of a burst, when
                # the band's first requests arrive together): the prior's prefill time.
                # Without it the reserve was the largest request alone there, and the next
                # large one waited 0.9-1.4 s (bench/RESULTS.md, fourteenth session).
                tokens += int(rate * prior.prefill_s)
            elif rate:
                if not self.rate_unsized:
                    log.warning(
                        "reserve for higher bands: no prefill speed measured yet (from the "
                        "engines' histograms or the access log), so their arrival rate is not "
                        "counted; keeping room for the largest recent requests only"
                    )
                self.rate_unsized += 1
            if short:
                tokens = max(tokens, self._largest_any[0])
            if tokens:
                best, top = max(best, tokens), max(top, p)
        if above:
            # Only a band below another sizes it: the top band's own requests (nothing
            # above them) read 0 and made the gauge flicker to 0 in the overload bench.
            self.last_held = best
        return best, top

    def _source(self, priority: int, on_prior: bool) -> None:
        """Say when a band's reserve starts or stops counting its configured prior."""
        if self.on_prior.get(priority) == on_prior:
            return
        self.on_prior[priority] = on_prior
        prior = self._priors[priority]
        if on_prior:
            log.info(
                "reserve for band %d sized from its reserve_prior (%d tokens, %.0f tokens/s) "
                "and its history (%d of %d requests)",
                priority,
                prior.tokens,
                prior.rate,
                self.history(priority),
                self.trusted_at,
            )
        else:
            log.info(
                "reserve for band %d now sized from measured history alone (%d requests)",
                priority,
                self.history(priority),
            )
