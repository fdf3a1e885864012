"""A per-endpoint latency model: time to first token and time per output token, learned
online from the engine's own latency histograms, predicted in microseconds.

The TTFT of a request sent to an endpoint is modelled as the engine serves prefills, one
after another on the accelerator:

    TTFT = overhead + backlog + prefill(uncached tokens)
    prefill(t) = per_request + per_token * t

- `per_request` and `per_token` are fitted by recursive least squares on each endpoint's
  histogram differences between scrapes: the prefill seconds added (`request_prefill_time`
  sum) against the requests and uncached tokens they prefilled (`request_prefill_time`
  count, `request_prefill_kv_computed_tokens` sum). No throughput is configured: a slower
  server simply fits a larger `per_token`, and forgetting lets the fit follow a server whose
  speed changes (another tenant on the GPU).
- `overhead` is what TTFT holds beyond queueing and prefill (tokenization, scheduling, the
  first decode step): the TTFT sum minus the queue and prefill sums, per request, smoothed.
- `transport` (added to TTFT) is the time outside the engine: from the decision to the
  response headers of streamed requests (servers send them on accepting the request).
- `backlog` is the prefill work ahead of the request: the placements of this picker the
  engine has not produced a first token for (counted against its first-token tally at each
  scrape, see `backlog.py`), priced with the current fit, plus, for each scraped waiting
  request beyond ours, the endpoint's mean prefill (requests other pickers or clients
  sent).

TPOT is fitted the same way from `inter_token_latency` against the running batch size:
`TPOT = base + per_sequence * (running + 1)`.

Token counts: the picker estimates a request's tokens from its text (or counts them exactly
in precise mode); the engine's histograms count with its own tokenizer. `token_scale`, the
engine's mean prompt tokens per request (`request_prompt_tokens`) over the picker's mean
estimate for the same requests (the oldest placements it has not counted yet: behind a
queue it counts requests placed seconds ago), converts one into the other, learned like
the rest.

An endpoint with too few samples borrows the fleet's median coefficients (its prediction
says `warm=False`); with no warm endpoint at all there is no prediction, and consumers fall
back to load scores (they say so in a metric, see `ModelStats`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Annotated

import msgspec

from extproc.core import EndpointState, LatencyTotals
from extproc.latency.backlog import Backlog
from extproc.latency.rls import RecursiveLeastSquares

# Tokens are fitted in thousands so both features of the prefill fit have similar scale.
_TOKEN_SCALE = 1000.0
# A prefill interval off the fit by more than this fraction (twice running) means the
# server's speed changed.
_CHANGE = 0.5
# A token-scale sample off by more than this factor (twice running) replaces the scale.
_SCALE_JUMP = 1.5
# Requests an overhead window must hold when its ends are not quiet (see _learn_overhead).
_OVERHEAD_WINDOW = 32
# Response-header delays above this are stalls, not the path's cost, and are not learned.
_MAX_TRANSPORT_S = 1.0
# Decode intervals whose median measures a slowdown (one odd interval, a stall of the
# machine or a batch change, moves nothing).
_DECODE_INTERVALS = 3
# Placements kept per endpoint for the token-scale match (bounded memory: beyond it the
# oldest go, and their engine counts are then compared with no estimate, i.e. skipped).
_MAX_UNCOUNTED = 1024


class ModelSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """Learning knobs (not throughputs: nothing here says how fast a server is), named as
    the producer's `model:` parameter spells them.

    `forgetting` (0.9): weight each fit keeps per new sample (about the last 10 intervals
    matter). `minSamples` (3): prefill intervals before an endpoint's own fit is used.
    `smoothing` (0.3): weight of a new interval in the smoothed means (overhead, mean
    uncached tokens per request). `lateHeads` (true): price an endpoint whose oldest
    unfinished placement has run longer than its price at the speed that placement shows.
    `decodeSlowdown` (false, with `lateHeads`): also price an endpoint at the slowdown its
    decode steps show, when a head is late and it is larger than the head's bound, or
    when it is 1.5 times or more on its own: a tenant's slowdown shows there within a
    scrape or two, long before a slowed prefill ends. Off by default: on vLLM, decode
    steps that share a step with a long prefill chunk (chunked prefill) stretch too, which
    says nothing of the prefill speed; measured on the simulator only (bench/RESULTS.md).
    """

    forgetting: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    min_samples: Annotated[int, msgspec.Meta(ge=1)] = 3
    smoothing: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.3
    late_heads: bool = True
    decode_slowdown: bool = False


@dataclass(frozen=True, slots=True)
class Coefficients:
    """One endpoint's fitted model (seconds). Replaced whole at each update, so the hot path
    reads a consistent set without locking."""

    per_request_s: float
    per_token_s: float
    overhead_s: float
    mean_tokens: float
    itl_base_s: float | None
    itl_per_seq_s: float
    samples: int

    def prefill_s(self, tokens: float) -> float:
        return self.per_request_s + self.per_token_s * tokens

    @property
    def tokens_per_s(self) -> float:
        """The learned prefill throughput (for operators; the model never reads it)."""
        return 1.0 / self.per_token_s if self.per_token_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted latency of one request on one endpoint. `warm` is False when the endpoint
    has too few samples and the fleet's coefficients stood in."""

    ttft_s: float
    tpot_s: float | None
    warm: bool
    # This request's own prefill there, and the requests queued ahead of it (ours not yet
    # started plus others waiting): see `cost_s`.
    prefill_s: float = 0.0
    queued: int = 0

    @property
    def ttft_ms(self) -> float:
        return self.ttft_s * 1000.0

    @property
    def cost_s(self) -> float:
        """TTFT plus the delay this request's prefill adds to the requests that will queue
        behind it: as many, in a queue that neither grows nor drains, as it finds ahead of
        it. Choosing by TTFT alone, a request whose prefix server is busy goes where it
        waits least, as a cache miss: several times the prefill of a hit, and more again
        on a slower server, for a slightly shorter wait; under load that work lengthens
        every later request's wait. With no queue it is the TTFT."""
        return self.ttft_s + self.prefill_s * self.queued

    @property
    def tpot_ms(self) -> float | None:
        return None if self.tpot_s is None else self.tpot_s * 1000.0


@dataclass(slots=True)
class ModelStats:
    """Counters since start, read by the metrics collector."""

    predictions_warm: int = 0
    predictions_borrowed: int = 0
    predictions_missing: int = 0
    samples: int = 0
    resets: int = 0
    reopened: int = 0  # fits reopened because a server's speed changed
    rescaled: int = 0  # token scale taken whole because the picker's estimates changed
    rescaled_speed: int = 0  # of those reopened, scaled at once by one prefill far off them
    late_heads: int = 0  # predictions priced at a late head's speed (see Backlog.slowdown)
    # priced at the slowdown the engine's decode steps show (`decode_slowdown`; see
    # LatencyModel._learn_itl)
    decode_priced: int = 0


class _Learned:
    """The learner's state for one endpoint (learner loop only)."""

    __slots__ = ("coeffs", "decode_ratios", "itl", "itl_base", "itl_ref", "mean_tokens",
                 "overhead", "overhead_base", "prefill", "prompt_base", "ratio", "running",
                 "surprises", "totals")  # fmt: skip

    def __init__(self, s: ModelSettings) -> None:
        self.totals: LatencyTotals | None = None
        self.running = 0
        self.prefill = RecursiveLeastSquares(2, forgetting=s.forgetting)
        self.itl = RecursiveLeastSquares(2, forgetting=s.forgetting)
        self.itl_base: LatencyTotals | None = None
        self.prompt_base: LatencyTotals | None = None
        self.overhead: float | None = None
        self.overhead_base: LatencyTotals | None = None  # start of the overhead window
        self.mean_tokens: float | None = None
        self.ratio: tuple[float, float] | None = None  # smoothed (prefill s / req, s / token)
        self.coeffs: Coefficients | None = None
        self.surprises = 0  # consecutive prefill samples far off the fit
        # The decode fit's weights when the prefill fit last matched a prefill the engine
        # timed, scaled with the prefill fit since (None: not matched since a reopen): the
        # decode speed the prefill fit's speed goes with.
        self.itl_ref: list[float] | None = None
        # The latest decode intervals' inter-token latency over itl_ref's at their batch
        # size: how much slower the server decodes than when the prefill fit was right.
        self.decode_ratios: deque[float] = deque(maxlen=_DECODE_INTERVALS)

    def coeffs_ready(self, min_samples: int) -> bool:
        return self.prefill.samples >= min_samples


class LatencyModel:
    """Predictions for every endpoint of the pool. `learn` runs in the learner loop, `predict`
    and `place` on the hot path; all on one event loop. `clock` is monotonic seconds."""

    def __init__(
        self, settings: ModelSettings | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or ModelSettings()
        self.now = clock
        self.stats = ModelStats()
        self._learned: dict[str, _Learned] = {}
        self._coeffs: dict[str, Coefficients] = {}  # warm endpoints only
        self._fleet: Coefficients | None = None
        self._backlog: dict[str, Backlog] = {}  # address -> our unfinished placements
        # address -> estimated prompt tokens of our placements the engine's prompt-token
        # histogram has not counted yet, oldest first (0: no estimate)
        self._placed: dict[str, deque[float]] = {}
        self.token_scale = 1.0  # engine tokens per estimated token
        self._scale_surprises = 0
        # address -> smoothed seconds from the decision to the response headers (streaming)
        self._transport: dict[str, float] = {}
        # address -> how much slower it decodes than when its prefill fit was last right
        self._decode_slowdown: dict[str, float] = {}

    # -- learning (off the hot path) -----------------------------------------------------

    def learn(
        self,
        address: str,
        totals: LatencyTotals | None,
        running: int = 0,
        waiting: int = 0,
        at: float | None = None,
    ) -> bool:
        """Feed one scrape's cumulative histograms and queue (taken at `at`, default now);
        True when it taught the model something."""
        if totals is None:
            return False
        backlog = self._backlog.get(address)
        if backlog is None:
            backlog = self._backlog[address] = Backlog()
        backlog.sync(totals.ttft_count, waiting, running, self.now() if at is None else at)
        st = self._learned.get(address)
        if st is None:
            st = self._learned[address] = _Learned(self.settings)
        learned = self._learn_prefill(st, totals)
        learned = self._learn_itl(st, totals, running) or learned
        learned = self._learn_scale(address, st, totals) or learned
        st.running = running
        if len(st.decode_ratios) == _DECODE_INTERVALS:
            self._decode_slowdown[address] = statistics.median(st.decode_ratios)
        else:
            self._decode_slowdown.pop(address, None)
        if learned:
            self.stats.samples += 1
            self._publish(address, st)
        return learned

    def _learn_prefill(self, st: _Learned, t: LatencyTotals) -> bool:
        last = st.totals
        if last is None or t.prefill_count < last.prefill_count or t.ttft_sum < last.ttft_sum:
            if last is not None:
                self.stats.resets += 1  # the engine restarted: counters began again
            st.totals = t
            return False
        n = t.prefill_count - last.prefill_count
        if n < 1:
            return False
        secs = t.prefill_sum - last.prefill_sum
        tokens = 0.0
        if t.prefill_tokens is not None and last.prefill_tokens is not None:
            tokens = max(0.0, t.prefill_tokens - last.prefill_tokens)
        x = (n, tokens / _TOKEN_SCALE)
        if st.coeffs_ready(self.settings.min_samples):
            # A sample far off the fit, twice running, is a server whose speed changed
            # (another tenant, throttling): reopen the fit so it follows within a few
            # intervals instead of the ~10 forgetting alone would take.
            expected = st.prefill.predict(x)
            if expected > 0 and abs(secs - expected) > _CHANGE * expected:
                st.surprises += 1
                if st.surprises == 1 and n == 1:
                    # One whole prefill far off: the engine timed it (no machine jitter in
                    # it), so take its speed now, as a factor on the whole fit (a tenant
                    # slows every term alike), and reopen it so the next samples correct
                    # what is not a common factor.
                    factor = secs / expected
                    st.prefill.w = [w * factor for w in st.prefill.w]
                    st.prefill.reopen()
                    if st.ratio is not None:
                        # The fallback means (see _publish) follow the same evidence: left
                        # to their smoothing they kept the old speed for ~5 more intervals
                        # whenever the reopened fit went negative (1-request intervals of
                        # similar size cannot separate its two terms).
                        st.ratio = (st.ratio[0] * factor, st.ratio[1] * factor)
                    if st.itl_ref is not None:  # the decode speed it goes with too
                        st.itl_ref = [w * factor for w in st.itl_ref]
                        ratios = [r / factor for r in st.decode_ratios]
                        st.decode_ratios.clear()
                        st.decode_ratios.extend(ratios)
                    self.stats.reopened += 1
                    self.stats.rescaled_speed += 1
                elif st.surprises >= 2:
                    st.prefill.reopen()
                    st.ratio = None  # the fallback means restart from this sample too
                    st.itl_ref = None  # and the decode speed it goes with, at its next match
                    st.decode_ratios.clear()
                    st.surprises = 0
                    self.stats.reopened += 1
            else:
                st.surprises = 0
                if st.itl.samples >= self.settings.min_samples:
                    st.itl_ref = list(st.itl.w)
                    st.decode_ratios.clear()  # the fit's speed is the server's again
        st.prefill.update(x, secs)
        a = self.settings.smoothing
        per_req, per_tok = secs / n, (secs / tokens if tokens > 0 else 0.0)
        st.ratio = (
            (per_req, per_tok)
            if st.ratio is None
            else (_ewma(st.ratio[0], per_req, a), _ewma(st.ratio[1], per_tok, a))
        )
        st.mean_tokens = _smooth(st.mean_tokens, tokens / n, a)
        self._learn_overhead(st, t)
        st.totals = t
        return True

    def _learn_overhead(self, st: _Learned, t: LatencyTotals) -> None:
        """TTFT not spent queued or prefilling, per request. The three histograms observe a
        request at different moments (the engine records queue time when its prefill starts,
        or at the end of the request; TTFT at the first token), so one scrape interval's
        differences mix requests: a request queued for a second whose wait was recorded in
        an earlier interval adds that second to this one's TTFT alone. Clipped at zero, such
        mixed samples read as 100-200 ms of overhead on a busy server (measured on the
        simulator, where the true figure is a few ms). So the sums are compared only over a
        window whose ends see the same number of requests between their observations (the
        count gaps agree): when no request is in between at either end the window holds
        the same requests in all three; otherwise the windows waits for a quiet scrape,
        or for enough requests that the in-between ones hardly count."""
        base = st.overhead_base
        if base is None or t.ttft_count < base.ttft_count or t.queue_count < base.queue_count:
            st.overhead_base = t
            return
        n = t.ttft_count - base.ttft_count
        if n < 1:
            return
        gap_now = (t.ttft_count - t.queue_count, t.ttft_count - t.prefill_count)
        gap_base = (base.ttft_count - base.queue_count, base.ttft_count - base.prefill_count)
        quiet = gap_now == gap_base == (0.0, 0.0)
        if not quiet and not (gap_now == gap_base and n >= _OVERHEAD_WINDOW):
            if n >= 4 * _OVERHEAD_WINDOW:
                st.overhead_base = t  # never settles: start again rather than mix forever
            return
        rest = (
            (t.ttft_sum - base.ttft_sum)
            - (t.queue_sum - base.queue_sum)
            - (t.prefill_sum - base.prefill_sum)
        ) / n
        st.overhead = max(0.0, _smooth(st.overhead, rest, self.settings.smoothing))
        st.overhead_base = t

    def _learn_itl(self, st: _Learned, t: LatencyTotals, running: int) -> bool:
        last = st.itl_base
        st.itl_base = t
        if last is None or t.itl_count < last.itl_count:
            return False
        n = t.itl_count - last.itl_count
        if n < 1:
            st.itl_base = last  # keep accumulating until tokens were produced
            return False
        mean_running = (st.running + running) / 2.0
        itl = (t.itl_sum - last.itl_sum) / n
        if st.itl_ref is not None:
            expected = st.itl_ref[0] + st.itl_ref[1] * mean_running
            if expected > 0:
                st.decode_ratios.append(itl / expected)
        st.itl.update((1.0, mean_running), itl)
        return True

    def _learn_scale(self, address: str, st: _Learned, t: LatencyTotals) -> bool:
        """One sample of engine tokens per estimated token: the engine's mean prompt tokens
        over the requests its histogram counted since the last scrape, against the
        picker's estimates for *those* requests. The engine counts a request when it
        starts or ends it, seconds after it was placed on a queued server, so the ones it
        counted are the oldest uncounted placements (it serves them first come first
        served), not the ones placed since the last scrape: comparing with those read
        the mix of prompt sizes placed during the queue's delay (3.9 -> 9.4 -> 1.5 on a
        constant tokenizer behind a 20-request queue)."""
        last = st.prompt_base
        placed = self._placed.get(address)
        if last is None or t.prompt_count < last.prompt_count:
            st.prompt_base = t
            if placed is not None and last is not None:
                placed.clear()  # the engine restarted: what it held is gone
            return False
        n = int(t.prompt_count - last.prompt_count)
        if n < 1:
            return False
        st.prompt_base = t
        if not placed:
            return False  # requests others sent: nothing of ours to compare with
        # More counted than ours uncounted: others sent some too, and which of ours were
        # among them is unknown; compare the means of all (and start the match afresh).
        counted = [placed.popleft() for _ in range(min(n, len(placed)))]
        if min(counted) <= 0:
            return False  # a placement without an estimate: nothing to compare with
        sample = ((t.prompt_sum - last.prompt_sum) / n) / (sum(counted) / len(counted))
        sample = min(20.0, max(0.05, sample))
        # Far off twice running: the picker's estimates changed scale (approximate mode
        # recalibrated its bytes per token), so every placement since is off by that much.
        if not 1 / _SCALE_JUMP < sample / self.token_scale < _SCALE_JUMP:
            self._scale_surprises += 1
            if self._scale_surprises < 2:
                return False  # one odd sample moves nothing
            self._scale_surprises = 0
            self.token_scale = sample
            self.stats.rescaled += 1
            return True
        else:
            self._scale_surprises = 0
        self.token_scale = _ewma(self.token_scale, sample, self.settings.smoothing)
        return True

    def _publish(self, address: str, st: _Learned) -> None:
        if st.prefill.samples < self.settings.min_samples or st.ratio is None:
            return
        w0, w1 = st.prefill.w
        per_req, per_tok = w0, w1 / _TOKEN_SCALE
        if per_tok < 0.0:
            # The intervals never varied in tokens per request: only the mean is known.
            per_req, per_tok = st.ratio[0], 0.0
        elif per_req < 0.0:
            per_req, per_tok = 0.0, st.ratio[1]
        itl_base = itl_per = None
        if st.itl.samples:
            itl_base, itl_per = st.itl.w
            if itl_per < 0.0:
                itl_base, itl_per = max(0.0, itl_base + itl_per * st.running), 0.0
        self._coeffs[address] = Coefficients(
            per_request_s=per_req,
            per_token_s=per_tok,
            overhead_s=st.overhead or 0.0,
            mean_tokens=st.mean_tokens or 0.0,
            itl_base_s=itl_base,
            itl_per_seq_s=itl_per or 0.0,
            samples=st.prefill.samples,
        )
        self._fleet = _median(self._coeffs.values())

    def retain(self, addresses: Collection[str]) -> None:
        """Forget endpoints that left the pool."""
        tables = (self._learned, self._coeffs, self._backlog, self._placed, self._transport,
                  self._decode_slowdown)  # fmt: skip
        for table in tables:
            for gone in [a for a in table if a not in addresses]:
                del table[gone]
        self._fleet = _median(self._coeffs.values())

    def coefficients(self, address: str) -> Coefficients | None:
        """The endpoint's own fit, None until it has `min_samples` intervals."""
        return self._coeffs.get(address)

    def all_coefficients(self) -> dict[str, Coefficients]:
        """Every warm endpoint's fit (a copy)."""
        return dict(self._coeffs)

    def transport_s(self, address: str) -> float | None:
        """Smoothed time outside the engine for `address` (None: no streamed response yet)."""
        return self._transport.get(address)

    @property
    def warm_endpoints(self) -> int:
        return len(self._coeffs)

    # -- the hot path --------------------------------------------------------------------

    def predict(
        self, address: str, state: EndpointState, uncached_tokens: float, now: float
    ) -> Prediction | None:
        """Predicted TTFT (and TPOT) of a request with `uncached_tokens` to prefill, sent to
        `address` now; None while no endpoint has a fit."""
        c = self._coeffs.get(address)
        warm = c is not None
        if c is None:
            c = self._fleet
            if c is None:
                self.stats.predictions_missing += 1
                return None
            self.stats.predictions_borrowed += 1
        else:
            self.stats.predictions_warm += 1
        scale = self.token_scale
        b = self._backlog.get(address)
        per_request_s, per_token_s = c.per_request_s, c.per_token_s
        transport_s = self._transport.get(address, 0.0)
        if self.settings.late_heads:
            # A head running past its price: the server slowed and the fit does not know
            # yet; price everything here at (at most) the speed the head shows.
            late = 1.0
            if b is not None:
                late = b.slowdown(per_request_s, per_token_s * scale, c.overhead_s, transport_s)
            slow = late
            if self.settings.decode_slowdown:
                # The head proves the server slowed at least this much, not by how much:
                # its bound grows with the time it runs. The decode steps measure the
                # slowdown itself (a tenant on the GPU slows every step alike) from the
                # first slowed token: taken when a head is late, or when far off alone.
                decode = self._decode_slowdown.get(address, 1.0)
                if decode > late and (late > 1.0 or decode > 1.0 + _CHANGE):
                    slow = decode
                    self.stats.decode_priced += 1
            if slow > 1.0:
                per_request_s, per_token_s = per_request_s * slow, per_token_s * slow
            if late > 1.0:
                self.stats.late_heads += 1
        backlog = 0.0 if b is None else b.work_s(per_request_s, per_token_s * scale, now)
        queued = 0 if b is None else len(b)
        if not state.is_stale and state.waiting:
            # Waiting requests beyond our unfinished placements are work
            # other pickers or clients queued there: our placements cannot show them.
            foreign = state.waiting - (0 if b is None else b.ours_waiting())
            if foreign > 0:
                backlog += foreign * (per_request_s + per_token_s * c.mean_tokens)
                queued += foreign
        prefill = per_request_s + per_token_s * uncached_tokens * scale
        ttft = c.overhead_s + transport_s + backlog + prefill
        tpot = None
        if c.itl_base_s is not None:
            running = (0 if state.is_stale else state.running) + 1
            tpot = max(0.0, c.itl_base_s + c.itl_per_seq_s * running)
        return Prediction(ttft, tpot, warm, prefill, queued)

    def responded(self, address: str, elapsed_s: float) -> None:
        """A streamed response's headers came back `elapsed_s` after the decision: servers
        send them once the request is accepted, before the first token, so this is the time
        outside the engine (proxy, network, HTTP) that its TTFT histogram does not show."""
        if not 0.0 <= elapsed_s < _MAX_TRANSPORT_S:
            return  # a stall, not the path's usual cost
        old = self._transport.get(address)
        self._transport[address] = elapsed_s if old is None else old + 0.1 * (elapsed_s - old)

    def place(
        self, address: str, uncached_tokens: float, now: float, prompt_tokens: float = 0.0
    ) -> None:
        """A request with `uncached_tokens` to prefill (of `prompt_tokens` estimated in all)
        was sent to `address`: its prefill is now ahead of every later request there."""
        placed = self._placed.get(address)
        if placed is None:
            placed = self._placed[address] = deque(maxlen=_MAX_UNCOUNTED)
        placed.append(max(0.0, prompt_tokens))
        b = self._backlog.get(address)
        if b is None:
            b = self._backlog[address] = Backlog()
        b.place(uncached_tokens, now)

    def backlogs(self) -> dict[str, Backlog]:
        """Our unfinished placements per endpoint (for metrics and tests; a copy)."""
        return dict(self._backlog)


def _ewma(old: float, new: float, a: float) -> float:
    return old + a * (new - old)


def _smooth(old: float | None, new: float, a: float) -> float:
    return new if old is None else _ewma(old, new, a)


def _median(coeffs: Collection[Coefficients]) -> Coefficients | None:
    """The fleet's typical endpoint, for endpoints that have not been measured yet."""
    if not coeffs:
        return None
    itl = [c.itl_base_s for c in coeffs if c.itl_base_s is not None]
    return Coefficients(
        per_request_s=statistics.median(c.per_request_s for c in coeffs),
        per_token_s=statistics.median(c.per_token_s for c in coeffs),
        overhead_s=statistics.median(c.overhead_s for c in coeffs),
        mean_tokens=statistics.median(c.mean_tokens for c in coeffs),
        itl_base_s=statistics.median(itl) if itl else None,
        itl_per_seq_s=statistics.median(c.itl_per_seq_s for c in coeffs),
        samples=0,
    )
