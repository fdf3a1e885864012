"""Cache affinity and load in one currency: predicted time to first token.

For each candidate: the prefill work queued ahead of the request there, plus the part of this
request's prompt that endpoint does not hold, both over that endpoint's prefill speed. A
request sticks to the endpoint holding its prefix until the wait there exceeds what
recomputing the prefix elsewhere costs; then it goes elsewhere, and (recorded there) the hot
prefix is replicated on a second endpoint while each session's longer tail keeps pulling it
back to where it grew. No weight between "affinity" and "load" needs calibrating.

The queue ahead is this picker's own virtual prefill queue per endpoint (each placement adds
its uncached tokens / speed; it drains in real time), floored by the endpoint's scraped
waiting requests at the mean placed prefill. By default (`inflightFloor: drained`) the
in-flight requests are no floor of their own: this picker's are in its virtual queue, and
the other replicas' in-flight tokens add what a prefill lane at the endpoint's speed would
not have computed since the exchange brought them (endpoints/peer_arrivals.py). Counted
until they end (`inflightFloor: untilEnd`, the default before the fifteenth session), time
spent decoding, in the gateway and waiting for the access log read as queued prefill: at the
tenants knee a tenant's holder looked 0.3-0.9 s deep with no prefill queued, and tenants
left it for a cold server, writing their prompt into a full cache (bench/RESULTS.md, issue
14, fourteenth and fifteenth sessions). `inflightFloor: untilFirstToken` counts only as many
as the engine reports before their first token (`_inflight_prefill`). With the peers'
placements folded in (below), the queue is the fleet's and the in-flight floor is left out.
Speeds are measured online
(`EndpointState.prefill_tps`: from the engines' prefill histograms, else the access log,
endpoints/prefill_speed.py); until the first measurement every endpoint gets the same
prior, which only scales all predictions alike.

The choice weighs one more cost than the prediction: the recompute a placement causes later.
Once an endpoint's cache has been written more than its size (the engine's KV capacity), every
token recomputed there evicts a resident one, which the request that would have reused it must
recompute. Moving a request off the endpoint holding L tokens of its prefix writes L more
tokens elsewhere than staying would, so it evicts L tokens someone else may need: the request
leaves its holder only when the wait there exceeds the recompute elsewhere by that future cost
too. How likely an evicted token is to be needed again is measured, not set: the share of
placed prompt tokens that were already cached (a workload without reuse loses nothing to an
eviction, and the rule then adds nothing). Endpoints of unknown capacity, or whose cache has
not filled yet, are charged nothing for evictions.

Replicas behind one gateway each place a share of the requests; a scorer that knew only its
own placements would see a queue and a written cache a fraction of the fleet's. With
`on_placed` set, each placement is handed out (server/shared_placements.py publishes it) and
`fold` applies a peer's placement here as if this picker had made it: every replica's queue,
written tokens, mean prefill and reuse share are drawn from every placement. Folded values
are validated and clamped: a forged one can neither grow the state nor push a queue past
`_MAX_QUEUE_S`.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, ClassVar, Literal, Protocol

import msgspec

from extproc.core import (
    Candidate,
    Decision,
    EndpointState,
    InferenceRequest,
    common_prefix_blocks,
)
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter

log = logging.getLogger(__name__)

# Fixed per-request cost (scheduling step, first decode step): keeps a fully cached request's
# prediction above zero, so ratios stay finite.
_FLOOR_S = 0.005
# Bounds on a peer's placement folded in (fold): no prompt is longer than this (the longest
# context windows are ~1-2M tokens), and no queue ahead on an endpoint is predicted past this
# (a real one that long means the request times out anyway; a forged one stops here).
_MAX_PROMPT_TOKENS = 1 << 23
_MAX_QUEUE_S = 600.0
# Placements kept per endpoint for the KV-fit term (those since the last scrape, and the
# ones still expected to run): a server takes a few per scrape interval and runs a few
# dozen at most, so this bounds memory and the per-candidate scan, not what is counted.
_MAX_LIVE = 128
# `spillCost`: a candidate counts as busy with more predicted queue ahead than this (a queue
# recovered from the prediction by subtraction is off by rounding where it is 0).
_BUSY_S = 1e-3
# The mean placed prefill's moving average: what of it each placement keeps.
_KEEP = 0.95


class PeerTokens(Protocol):
    """The other replicas' in-flight tokens per endpoint, dated by arrival
    (endpoints/peer_arrivals.py `PeerArrivals`)."""

    def total(self, address: str) -> int: ...
    def pending(self, address: str, now: float, tps: float) -> float: ...
    def pending_shared(self, address: str, now: float, tps: float) -> float: ...
    def since(self, address: str, t: float) -> float: ...
    def placed(self, address: str) -> float: ...


def uncached_tokens(req: InferenceRequest, c: Candidate) -> float:
    n = len(req.block_keys)
    if not n:
        return float(req.prompt_tokens)
    held = min(1.0, c.prefix_blocks / n)
    return req.prompt_tokens * (1.0 - held)


class PredictedTTFTScorer:
    """Scores each endpoint by predicted TTFT: best / own (1.0 for the fastest), so a
    max-score picker sends the request where its first token comes soonest.

    `inflightFloor`: how the in-flight requests floor the queue ahead (without shared
    placements): `drained` (default) no in-flight floor; the virtual queue plus the peers'
    in-flight tokens a lane at the endpoint's speed would not have computed since they
    arrived (one replica: the virtual queue alone). Default since the fifteenth session: at
    the tenants knee better on hit ratio in every interleaved pair, and on agentic the same
    sessions on the same servers as `untilEnd` (bench/RESULTS.md, issue 14). `untilEnd`
    counts each one's prompt until it ends, decoding included (the default before);
    `untilFirstToken` counts only as many as the engine reports before their first token
    (`_inflight_prefill`). Opt-in: interleaved runs did not show it better on every
    workload (bench/RESULTS.md, issue 14, eighth session).

    `peerInflight`: with `inflightFloor: untilEnd` or `untilFirstToken`, how the other
    replicas' share of those in-flight tokens counts (shared in-flight counts, no shared
    placements; `inflightFloor: drained` always drains them): `drained` (default) only
    what a prefill lane at the endpoint's speed would not have computed since each exchange
    brought it
    (endpoints/peer_arrivals.py); `whole` counts it until the requests end, which on several
    replicas made a busy holder look deeper than on one and moved tenants off it (drained
    won every interleaved tenants pair on a quiet machine, bench/RESULTS.md, issue 14,
    tenth session). `sharedLane`: as `drained`, but the lane also computes this replica's
    own in-flight tokens, in order of arrival with the peers' (both dated by the exchange),
    so the peers' drain waits behind the own work ahead of it (`PeerArrivals.pending_shared`):
    `drained` drained the peers' tokens on a server this replica was loading too, and three
    replicas spilled onto it as if it were empty (bench/RESULTS.md, issue 14, eleventh
    session). Opt-in. A replica's own in-flight tokens count whole in every mode, so one
    replica decides the same with all three.

    `meanPlacements`: whose placements the mean placed prefill (what each scraped waiting
    request counts as, above) averages. `fleet` (default since the twenty-first session): also
    the other replicas' placements the shared in-flight exchange brings (their requests and
    uncached tokens, pushed or exchanged), so every replica averages the same stream one replica
    would. `own`: this replica's own and folded placements (the behaviour before). The mean is a
    moving average per placement seeded with the first one (a cold prompt); each of three
    replicas gets a third of the placements, so it forgot the cold start three times slower: at
    the tenants knee (seed 2) every replica's mean was ~2x one replica's for the first 4-5 s, a
    holder's 2-4 waiting requests counted twice the prefill, and three replicas left visible
    holders for cold servers 9-10 times in the second second against one replica's 2-3, the
    start of the runs that tipped into a cascade (bench/RESULTS.md, issue 14, twenty-first
    session). A peer's tokens are in its estimate units; pooled calibration keeps them the
    replicas' own (one placed before a recalibration and seen after it counts in the old unit).
    Not while the peers' placements are folded in (they are in the mean already). Without shared
    in-flight counts, or while the exchange fails (logged and counted there), the mean is
    `own`'s. The default: in eleven interleaved seed-2 pairs (seven by the helper that built it,
    four by the lead on a quiet machine) three replicas' p90 over one's had a median of 1.17x
    against `own`'s 1.45x, and fewer runs cascaded; seed 4 within noise (0.91x / 1.03x against
    0.88x / 1.03x). One replica decides the same with both: it has no peers.

    `writtenPlacements`: whose placements count as written into an endpoint's cache (what
    the eviction cost, above, charges once it is full). `fleet` (default since the
    twenty-fourth session): this replica's own and folded placements and the uncached tokens
    the other replicas placed there, as the shared in-flight exchange brings them (pushed or
    exchanged, endpoints/peer_arrivals.py `placed`), so every replica counts a cache full when
    one replica would. `own`: this replica's own and folded placements (the behaviour
    before). With `own` each of three replicas counts a third of what the fleet wrote: at
    multimodal 16 req/s one replica charged the eviction cost in 60 of 60 decisions and
    each of three replicas in 20 of 60, and three replicas left a prefix holder on score 19
    times in 60 against one replica's 10, 12 of them by less than the 0.3 s that cost adds
    to a cold server (bench/RESULTS.md, issue 14, twenty-fourth session). Not while the
    peers' placements are folded in (they are written already). Without shared in-flight
    counts, or while the exchange fails (logged and counted there), as `own`. One replica
    decides the same with both. The default: at 16 req/s (multimodal and text, two seeds
    each, plus two traced pairs) three replicas' TTFT p90 was lower than with `own` in 9 of 10
    interleaved pairs (by up to 24%) and higher in one (+5%), hit ratio higher or level in
    all 10, and within 10% of one replica's in 7 of 8 pairs against 3 of 8; 6 and 12 req/s
    level; the tenants knee +2% / +5% (one seed, within its spread).

    `speedUnits`: `engine` (default) takes each measured prefill speed as the engine gives
    it, in its tokens; `estimates` divides it by the engine tokens per estimated token that
    the KV-capacity model measured (index/capacity.py; with no approximate index, as
    `engine`), so queues of estimated tokens drain at the speed they really do. Uncalibrated
    (4 bytes per token for the simulator's ~1.3 characters) the virtual queue and the
    peers' lane drained ~3x too fast; calibrated (1 byte per token) ~1.3x too slow. Opt-in
    (bench/RESULTS.md, issue 14, twelfth session).

    `waitingFloor`: what each of the endpoint's scraped waiting requests counts as queued
    prefill: `fleetMean` (default) the mean uncached tokens of every placement this picker
    made or folded; `endpointMean` the mean of the requests in flight on that endpoint
    (its in-flight tokens over its in-flight requests, shared by every replica) for as many
    waiting requests as it has in flight, the fleet mean for the rest. A tenant's holder
    queues mostly hits of a few hundred tokens, which the fleet's mean (cold prompts
    included) counted as thousands. Opt-in and not recommended: it lowers the other
    servers' floors as much as the holder's, and on three replicas it lost tenants' holders
    more often on the quietest set measured (bench/RESULTS.md, issue 14, eleventh session).

    `kvFit`: whether a request that does not fit in the endpoint's free KV cache waits for
    it. `wait`: when the blocks its running requests hold (scraped `kv_usage`), plus the
    uncached tokens placed there since that scrape, plus this request's uncached tokens
    exceed the endpoint's KV capacity (`kv_blocks` x `kv_block_size`; estimates converted by
    the KV-capacity model's ratio), the queue ahead is at least the wait until the earliest
    running request ends (`_kv_wait`). At the tenants knee a tenant's ~2,560 tokens are 40%
    of a 6,400-token cache: a server runs about two at once and the third waits for blocks,
    hit or not, which the prefill queue alone does not see (bench/RESULTS.md, issue 14,
    eighteenth session). `ignore` leaves the cache's room out of the prediction.

    `kvFitPeers`: with `kvFit: wait` on several replicas, whose placements since the scrape
    take room: `folded` (default) only this scorer's own and folded placements; `arrivals`
    also the other replicas' placements there from the shared in-flight exchange (pushed
    at decision time, endpoints/peer_arrivals.py), unless the peers' placements are folded
    in already. Three replicas raced for the same free KV: 28-43 of a knee run's KV waits
    came within 0.1 s after a different replica placed on the same server, before any
    scrape showed it. `arrivals` sees about half of those placements but did not reduce
    the races, and was not better than `folded` pair for pair (seed 2 worse in 4 of 6 pairs,
    seed 4 better in 3 of 4), so opt-in (bench/RESULTS.md, issue 14, twentieth session).

    `kvFitPrefix`: what this request's cached prefix costs in that count. `running`
    (default): nothing where a placement of this scorer's still running there shares it,
    its blocks elsewhere (a cached block no running request references is free in the
    engine's count, and a hit takes it out of the free pool); where other replicas have
    requests in flight on the endpoint, nothing (their prefixes are not known here).
    `held`: nothing anywhere (the uncached part alone, as in the nineteenth session): it
    missed half the real KV waits at the tenants knee (bench/RESULTS.md, issue 14,
    twentieth session).

    `kvFitMargin` (seconds, default 0.1): at a candidate holding more of the prompt than
    the candidate holding least, this much of the KV-fit wait is not counted
    (`holder_margin`), so a request leaves its prefix holder for a KV wait only when the
    wait exceeds the recompute elsewhere by the margin; 0 counts the wait whole.

    `spillCost`: whether a candidate pays for the prefill it adds to the fleet. `fleetBusy`:
    each candidate is charged the recompute it causes beyond the candidate holding most of
    the prompt (its extra uncached tokens over its speed), times the share of the
    candidates busy with prefill now (a predicted queue ahead: virtual queue, peers'
    pending tokens, scraped waiting floor; `spill_charge`). The prediction is one
    request's; a spill's second prefill is lane time every later request queues behind
    once the lanes are busy: at multimodal 16 req/s, 17 of 48 repeats left their holder,
    each no slower itself, each adding ~0.55 s of prefill to lanes ~70% busy, and
    sglang-router, keeping every repeat on its holder, had the lower TTFT p50 (0.66 s
    against 0.99 s) and the oracle's hit ratio against 63% (bench/RESULTS.md, issue 14,
    twenty-third session). On an idle fleet the charge is ~0 and a request still leaves a
    holder whose queue exceeds the recompute. The default since the twenty-fourth session
    (`ignore`, charging nothing, before): at that step (seed 1) the charge was better in 3 of 3
    pairs (hit 45-52% against 36-38%, TTFT p90 1.18-1.27 s against 1.52-1.56 s); on arrival seed
    4 better 2 of 2 (hit 49% against 43%, p90 0.72 s against 0.81 s); seed 3 no gain (p90 higher
    in 2 of 3 pairs, up to 0.15 s), seed 5 even; text, agentic unchanged; the tenants knee even
    to better on one replica. Three replicas at the tenants knee were worse on two seeds of
    three before `writtenPlacements: fleet` became the default, even to better on all three (6
    of 6 pairs) after it; there the charge moves 1-7 picks of ~240 a run, so those pairs mostly
    measure which trajectory a run took (bench/RESULTS.md, issue 14, twenty-third and
    twenty-fourth sessions: spillcost, spilldefault, spill3r).

    ```yaml
    - type: predicted-ttft-scorer
      parameters: {priorPrefillTokensPerSecond: 10000, inflightFloor: drained,
                   peerInflight: drained, waitingFloor: fleetMean, meanPlacements: fleet,
                   writtenPlacements: fleet, speedUnits: engine,
                   kvFit: ignore, kvFitPeers: folded, kvFitPrefix: running,
                   kvFitMargin: 0.1, spillCost: fleetBusy}
    ```
    """

    type_name: ClassVar[str] = "predicted-ttft-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        # Used only before any endpoint's speed has been measured.
        prior_prefill_tokens_per_second: Annotated[float, msgspec.Meta(gt=0.0)] = 10000.0
        inflight_floor: Literal["untilEnd", "untilFirstToken", "drained"] = "drained"
        peer_inflight: Literal["whole", "drained", "sharedLane"] = "drained"
        waiting_floor: Literal["fleetMean", "endpointMean"] = "fleetMean"
        mean_placements: Literal["own", "fleet"] = "fleet"
        written_placements: Literal["own", "fleet"] = "fleet"
        speed_units: Literal["engine", "estimates"] = "engine"
        kv_fit: Literal["ignore", "wait"] = "ignore"
        kv_fit_peers: Literal["arrivals", "folded"] = "folded"
        kv_fit_prefix: Literal["running", "held"] = "running"
        kv_fit_margin: Annotated[float, msgspec.Meta(ge=0.0, le=_MAX_QUEUE_S)] = 0.1
        # The default since the twenty-fourth session (bench/RESULTS.md, issue 14).
        spill_cost: Literal["ignore", "fleetBusy"] = "fleetBusy"

    def __init__(
        self, params: Params | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        p = params or self.Params()
        self._prior = p.prior_prefill_tokens_per_second
        self._until_first_token = p.inflight_floor == "untilFirstToken"
        self._floor_drained = p.inflight_floor == "drained"
        self._drain_peers = p.peer_inflight != "whole"
        self._shared_lane = p.peer_inflight == "sharedLane"
        self._endpoint_mean = p.waiting_floor == "endpointMean"
        self._pool_mean = p.mean_placements == "fleet"
        self._pool_written = p.written_placements == "fleet"
        self._speed_in_estimates = p.speed_units == "estimates"
        self._kv_fit = p.kv_fit == "wait"
        self._kv_fit_peers = p.kv_fit_peers == "arrivals"
        self._prefix_held = p.kv_fit_prefix == "held"
        self._kv_margin = p.kv_fit_margin
        self._spill_cost = p.spill_cost == "fleetBusy"
        self._clock = clock
        self._busy_until: dict[str, float] = {}
        # Tokens, moving average of placed uncached prompts; None until the first placement
        # (starting from 0 made scraped waiting requests weigh nothing for ~20 placements,
        # so a server loaded behind the picker's back kept its share of new prefixes).
        self._mean_prefill: float | None = None
        # The peers' placements (requests, uncached tokens) seen so far, cumulative (the
        # shared in-flight exchange sets it; None: not shared), for `meanPlacements: fleet`;
        # the part already in the mean; the peers' placements pooled into it.
        self.peer_placements: Callable[[], tuple[int, int]] | None = None
        self._pooled_upto = (0, 0)
        self.mean_pooled = 0
        # Per endpoint, (estimated) tokens this picker has had it compute: once over its KV
        # capacity, its cache is full and each new token evicts one.
        self._written: dict[str, float] = {}
        # `writtenPlacements: fleet`: per endpoint, the peers' placed tokens
        # (`PeerTokens.placed`) already in `_written`; and their sum, pooled so far.
        self._written_upto: dict[str, float] = {}
        self.written_pooled = 0.0
        # Moving average of the share of each placed prompt that was already cached: how
        # likely a resident token is to be asked for again.
        self._reuse = 0.0
        # Each placement (address, uncached tokens, prompt tokens, prefill seconds) for the
        # peers (server/shared_placements.py); None: not shared.
        self.on_placed: Callable[[str, float, int, float], None] | None = None
        # True while the peers' placements are folded in (server/shared_placements.py sets it;
        # False while Redis fails): the virtual queue then is the fleet's, and the in-flight
        # floor is not taken. None: not shared.
        self.fleet_folded: Callable[[], bool] | None = None
        # Predictions whose in-flight floor counted every in-flight request whole, the
        # engine's count of requests before their first token missing or stale
        # (`_inflight_prefill`); endpoints already logged, bounded.
        self.floor_fallbacks = 0
        self._fallen_back: set[str] = set()
        # The peers' in-flight tokens dated by arrival (the shared in-flight counts' exchange
        # sets it; None: a single process, or counts not shared). Read with `drained`.
        self.peer_arrivals: PeerTokens | None = None
        # Peers' in-flight tokens left out of floors as already computed (`drained`), summed.
        self.peer_tokens_drained = 0.0
        # Engine tokens per estimated token (the KV-capacity model's measured ratio; the
        # server's assembly sets it): `speedUnits: estimates` divides measured speeds by it.
        # None: not known (no approximate index), speeds taken as they are.
        self.token_ratio: Callable[[], float] | None = None
        # Per endpoint, recent placements (own and folded) for `kvFit: wait`: (placed at,
        # uncached tokens, predicted end of its prefill), oldest first.
        self._live: dict[str, deque[tuple[float, float, float]]] = {}
        # Mean decode seconds of a request on an endpoint (endpoints/decode_time.py; the
        # server's assembly sets it). None: not measured, and `kvFit: wait` then times a
        # wait by the running prefills' ends alone, counted in `kv_fit_untimed`.
        self.decode_s: Callable[[str], float | None] | None = None
        # `kvFit: wait`: predictions that waited for KV blocks; of those, the ones timed
        # without a decode measurement; scored requests whose fastest endpoint the wait
        # changed (this scorer's pick; the profile's sum of scorers decides the request).
        self.kv_fit_waits = 0
        self.kv_fit_untimed = 0
        self.kv_fit_changed = 0
        # Of `kv_fit_waits`, those the peers' placements since the scrape alone made wait
        # (`kvFitPeers: arrivals`: without them the request fit).
        self.kv_fit_peers = 0
        self._untimed_said = False
        # Per endpoint, this scorer's own recent placements for `kvFitPrefix: running`: (end
        # of its predicted prefill, the request's block keys), oldest first. The keys say
        # which cached prefix a still-running request holds; folded peers' placements carry
        # none.
        self._running_keys: dict[str, deque[tuple[float, tuple[int, ...]]]] = {}
        # `kvFit: wait`: waits only because the request's cached prefix, held by no running
        # placement, was counted (it would have fit without); predictions that took the
        # prefix as held because a peer has requests in flight there (their keys unknown).
        self.kv_fit_idle_prefix = 0
        self.kv_fit_prefix_unknown = 0
        self._unknown_said = False
        # `spillCost: fleetBusy`: decisions that charged some candidate a spill (the fleet
        # busy and the prefix held more on one candidate than another), and scored requests
        # whose fastest endpoint the charge changed.
        self.spill_charged = 0
        self.spill_changed = 0

    def units_changed(self, factor: float) -> None:
        """Estimates grew `factor`-fold: the mean placed prefill follows (the prior speed is a
        guess in no unit in particular; measured speeds are rescaled where they are kept)."""
        if factor > 0 and self._mean_prefill is not None:
            self._mean_prefill *= factor
        if factor > 0:
            self._written = {a: n * factor for a, n in self._written.items()}
            for live in self._live.values():
                scaled = [(at, n * factor, end) for at, n, end in live]
                live.clear()
                live.extend(scaled)

    def endpoint_reset(self, address: str) -> None:
        """`address` restarted or left: its cache is empty (see `cache_cleared`) and the
        prefill queued there is gone."""
        self.cache_cleared(address)
        self._busy_until.pop(address, None)
        self._live.pop(address, None)
        self._running_keys.pop(address, None)

    def cache_cleared(self, address: str) -> None:
        """`address`'s cache is empty: nothing written there, so no eviction charged until it
        fills again. Without this, a cleared cache (precise mode's AllBlocksCleared) kept the
        count of the tokens written before it and was charged as full from its first
        request on."""
        self._written.pop(address, None)
        if self.peer_arrivals is not None:
            # What the peers wrote there so far went with the old cache.
            self._written_upto[address] = self.peer_arrivals.placed(address)

    def _tps(self, c: Candidate) -> float:
        tps = c.state.prefill_tps
        if not tps:
            return self._prior
        if self._speed_in_estimates:
            # The engine's speed is in its tokens; queues and prompts here are estimates.
            # A common factor leaves static comparisons alone, but not a drain in real
            # time: with 4 bytes per token for ~1.3 characters (uncalibrated), a queue of
            # estimates at the engine's speed drained 3x too fast (issue 14, twelfth
            # session).
            return tps / self._ratio()
        return tps

    def predict(
        self,
        req: InferenceRequest,
        c: Candidate,
        now: float,
        terms: dict[str, float] | None = None,
    ) -> float:
        """Seconds until `c` would return this request's first token. `terms`, when given,
        gets each term of the prediction (`explain`): one code path, so an explanation
        cannot drift from what was scored."""
        return self._predict(req, c, now, terms)[0]

    def _predict(
        self,
        req: InferenceRequest,
        c: Candidate,
        now: float,
        terms: dict[str, float] | None = None,
    ) -> tuple[float, float]:
        """The prediction, and the seconds the KV-fit wait added to it."""
        tps = self._tps(c)
        wait = self._busy_until.get(c.endpoint.address, now) - now
        st = c.state
        if terms is not None:
            terms["virtual_queue_s"] = max(0.0, wait)
        # The peers' placements already in the virtual queue: no in-flight floor on top.
        folded = self.fleet_folded is not None and self.fleet_folded()
        if self._floor_drained:
            # No in-flight floor: this replica's own placements are its virtual queue, and
            # the peers' in-flight tokens count as far as a lane has not computed them, on
            # top (one lane serves both).
            arrivals = self.peer_arrivals
            if arrivals is not None and not folded:
                address = c.endpoint.address
                if arrivals.total(address):
                    pending = arrivals.pending(address, now, tps) / tps
                    wait = max(0.0, wait) + pending
                    if terms is not None:
                        terms["peers_pending_s"] = pending
        elif st.inflight_tokens and not folded:
            # Prompt tokens every replica placed there (shared through Redis): this replica's
            # own queue sees only its share. Dropped when the queue already folds every
            # replica's placements (bench/RESULTS.md, issue 14, seventh session, third part).
            address = c.endpoint.address
            tokens = float(st.inflight_tokens)
            arrivals = self.peer_arrivals
            if self._drain_peers and arrivals is not None:
                # The peers' share only as far as a lane at this speed has not computed it
                # since it arrived: counted until the requests end, the time they spend
                # decoding, in the gateway and the access log's flush read as queue
                # (bench/RESULTS.md, issue 14, tenth session).
                peers = min(float(arrivals.total(address)), tokens)
                if terms is not None:
                    terms["peer_inflight_tokens"] = peers
                if peers:
                    pending = (
                        arrivals.pending_shared(address, now, tps)
                        if self._shared_lane
                        else arrivals.pending(address, now, tps)
                    )
                    drained = max(0.0, peers - pending)
                    tokens -= drained
                    if terms is None:  # explain re-runs a scored prediction: counted once
                        self.peer_tokens_drained += drained
            floor = self._inflight_prefill(st, address, tokens, count=terms is None) / tps
            if terms is not None:
                terms["inflight_floor_s"] = floor
            wait = max(wait, floor)
        if st.waiting and not st.is_stale:
            # Before any placement, this request's own prompt is the best guess of a queued one.
            mean = self._mean_prefill if self._mean_prefill is not None else req.prompt_tokens
            queued = st.waiting * mean
            if self._endpoint_mean and st.inflight_requests:
                # As many waiting requests as the pickers have in flight there at their mean;
                # the rest (sent behind the pickers' back, or placed by a peer since the last
                # exchange) at the fleet's.
                known = min(st.waiting, st.inflight_requests)
                own = st.inflight_tokens / st.inflight_requests
                queued = known * own + (st.waiting - known) * mean
            if terms is not None:
                terms["waiting_floor_s"] = queued / tps
            wait = max(wait, queued / tps)
        added = 0.0
        if self._kv_fit:
            # A floor, not a sum: while it waits for blocks the prefills ahead go on, and once
            # admitted it queues behind what is left of them.
            kv = self._kv_wait(req, c, now, count=terms is None)
            if terms is not None:
                terms["kv_fit_wait_s"] = kv
                terms["kv_peer_tokens"] = self._peers_since(c, now)
            added = max(0.0, kv - max(0.0, wait))
            wait = max(wait, kv)
        uncached = uncached_tokens(req, c) / tps
        if terms is not None:
            terms["queue_s"] = max(0.0, wait)
            terms["uncached_s"] = uncached
        return max(0.0, wait) + uncached + _FLOOR_S, added

    def _ratio(self) -> float:
        """Engine tokens per estimated token (1.0 when not measured)."""
        if self.token_ratio is None:
            return 1.0
        ratio = self.token_ratio()
        return ratio if ratio > 0 and math.isfinite(ratio) else 1.0

    def _kv_wait(
        self, req: InferenceRequest, c: Candidate, now: float, *, count: bool = True
    ) -> float:
        """Seconds until `c` has room in its KV cache for this request (0: room now, or not
        known). Room: the scraped `kv_usage` (blocks its running and admitted requests hold)
        plus the uncached tokens placed there since that scrape (`_placed_since`: own,
        folded and the other replicas'; the engine had not seen them) plus this request's
        tokens (below), against `kv_blocks` x `kv_block_size`. Over capacity, the wait is
        until the earliest running request ends: a placement of this scorer's still expected
        to run ends a decode after its predicted prefill; without one, the soonest of the
        `running` requests, each
        somewhere in its decode, ends in about decode / (running + 1).

        This request's tokens: its uncached part, plus its cached prefix where no running
        placement holds it (`_kv_need`; with `kvFitPrefix: held` the uncached part alone).
        A cached prefix a running request holds costs no block (at the tenants knee a
        tenant's holder mostly runs the same tenant's requests); one no request holds is
        free in the engine's count and reusing it takes it out of the free pool. Counting
        whole prompts everywhere waited in 48% of the predictions at the knee and moved 35-40
        requests a run off their holders: hit ratio 61% / 59% against 65% / 65%, p90 +30% /
        +21% (bench/RESULTS.md, issue 14, nineteenth session); counting uncached parts only
        missed half the real waits (twentieth session).

        What else this ignores: one request's end may free too little (then it waits for
        more), requests already queued for blocks ahead of it (the engine admits first come
        first served), the output's blocks (vLLM allocates them as it decodes), and a peer's
        placements since the scrape when neither placements nor in-flight counts are shared
        (they show at the next scrape)."""
        st = c.state
        if not (st.kv_blocks and st.kv_block_size) or st.is_stale:
            return 0.0
        ratio = self._ratio()
        cap = float(st.kv_blocks * st.kv_block_size)
        tokens, idle = self._kv_need(req, c, now, count=count)
        need = tokens * ratio
        if need >= cap:
            return 0.0  # fits beside nothing: the engine runs it alone or refuses it
        address = c.endpoint.address
        live = self._live.get(address)
        own, peers = self._placed_since(c, now)
        if st.kv_usage * cap + (own + peers) * ratio + need <= cap:
            return 0.0
        if count and peers and st.kv_usage * cap + own * ratio + need <= cap:
            self.kv_fit_peers += 1
        if count and st.kv_usage * cap + (own + peers) * ratio + need - idle * ratio <= cap:
            self.kv_fit_idle_prefix += 1
        decode = self.decode_s(address) if self.decode_s is not None else None
        if decode is None:
            if count:
                self.kv_fit_untimed += 1
            if not self._untimed_said:
                self._untimed_said = True
                log.warning(
                    "predicted-ttft-scorer: no engine's decode time measured "
                    "(vllm:request_decode_time_seconds): a wait for KV blocks is timed by "
                    "the running prefills' ends alone "
                    "(extproc_predicted_ttft_kv_fit_total{outcome='untimed'})"
                )
            decode = 0.0
        ends = [end + decode for _, _, end in live if end + decode > now] if live else []
        wait = min(ends) - now if ends else decode / (max(st.running, 1) + 1)
        if count:
            self.kv_fit_waits += 1
        return wait

    def _placed_since(self, c: Candidate, now: float) -> tuple[float, float]:
        """Uncached tokens (estimates) placed on `c` that the scraped `kv_usage` does not
        hold yet: this scorer's own and folded placements since the scrape, and the other
        replicas' since the scrape (`_peers_since`), separately. Requests placed before the
        scrape and still queued for blocks are not counted (they hold none yet): counting
        the scraped waiting requests at the mean placed tokens showed no effect in four
        runs and was withdrawn (bench/RESULTS.md, issue 14, twentieth session)."""
        st = c.state
        live = self._live.get(c.endpoint.address)
        since = now - (st.age_s or 0.0)
        own = sum(n for at, n, _ in live if at > since) if live else 0.0
        return own, self._peers_since(c, now)

    def _peers_since(self, c: Candidate, now: float) -> float:
        """The other replicas' uncached tokens placed on `c` since its last scrape, from the
        shared in-flight exchange (0 with `kvFitPeers: folded`, without shared counts, or
        while their placements are folded into `_live`, which would count them twice).

        Units: the in-flight counts are the uncached tokens the deciding replica's index
        predicted (router.py: prompt less its matched blocks), the same estimate
        `uncached_tokens` gives here, so they are added as they are; not whole prompts,
        which counted a tenant's shared prefix again at its holder (nineteenth session).
        A peer's count is in its units at the time: placements made before a recalibration
        of the estimates count in the old ones until the next scrape."""
        arrivals = self.peer_arrivals
        if not self._kv_fit_peers or arrivals is None:
            return 0.0
        if self.fleet_folded is not None and self.fleet_folded():
            return 0.0
        return arrivals.since(c.endpoint.address, now - (c.state.age_s or 0.0))

    def _kv_need(
        self, req: InferenceRequest, c: Candidate, now: float, *, count: bool = True
    ) -> tuple[float, float]:
        """Tokens (estimates) this request takes out of `c`'s free KV blocks, and how many of
        them are its cached prefix. The uncached part always; the cached part too unless a
        request still running there holds it. A cached block no running request references
        is free in the engine's count (`kv_usage`), and a hit on it takes it out of the free
        pool (vLLM's free block queue; the sim's `can_allocate` counts such idle hits): a
        tenant's hit on a holder where none of its requests runs needs its whole prompt.
        Counting only the uncached part missed half the real KV waits at the tenants knee,
        most of them such hits (seed 4: 25 of 49 and 25 of 37 waits > 20 ms unpredicted,
        bench/RESULTS.md, issue 14, twentieth session). Counting the whole prompt everywhere
        (nineteenth session) over-counted where the same tenant runs: there the prefix is
        shared, so the part a running placement of this scorer's shares (the longest common
        run of chained block keys, up to what `c` holds) stays free of charge.

        A running placement: this scorer's own, until its predicted prefill end plus the
        engine's mean decode time (no decode measured: its prefill end). A peer's placements
        carry no keys; where the peers have requests in flight on `c` the prefix is taken as
        held, as with `kvFitPrefix: held` (counted in `kv_fit_prefix_unknown`, logged once):
        counting it there would charge a shared prefix whenever a peer's request shares it.
        What this leaves out: a prefix held by a request sent behind the pickers' back, and
        the output's blocks (vLLM allocates them as it decodes)."""
        uncached = uncached_tokens(req, c)
        keys = req.block_keys
        n = len(keys)
        held = min(c.prefix_blocks, n)
        if self._prefix_held or not held:
            return uncached, 0.0
        address = c.endpoint.address
        arrivals = self.peer_arrivals
        if arrivals is not None and arrivals.total(address):
            if count:
                self.kv_fit_prefix_unknown += 1
            if not self._unknown_said:
                self._unknown_said = True
                log.warning(
                    "predicted-ttft-scorer: kvFit takes a request's cached prefix as held "
                    "where other replicas have requests in flight (which prefix they hold "
                    "is not shared; extproc_predicted_ttft_kv_fit_total"
                    "{outcome='prefix_unknown'})"
                )
            return uncached, 0.0
        shared = 0
        running = self._running_keys.get(address)
        if running:
            decode = (self.decode_s(address) if self.decode_s is not None else None) or 0.0
            # Newest first: the prefill ends of one endpoint's placements never decrease (each
            # queues behind the one before), so the first that has ended ends the scan.
            for end, other in reversed(running):
                if end + decode <= now or shared >= held:
                    break
                shared = max(shared, common_prefix_blocks(keys, other, int(held)))
        idle = req.prompt_tokens * (held - shared) / n
        return uncached + idle, idle

    def _inflight_prefill(
        self, st: EndpointState, address: str, tokens: float, *, count: bool = True
    ) -> float:
        """The in-flight tokens that can still be in prefill on the endpoint. In-flight
        counts last until a request ends, decoding included: counted whole, a server
        streaming long answers looked seconds deep and sessions left the server holding
        their prefix (issue 14, eighth session). The engine says how many of its requests
        are before their first token (`prefilling`, endpoints/state.py); only that many of
        the in-flight requests count, at their mean tokens (the engine serves prefills
        first come first served, so those are the youngest; their sizes are not kept).
        Requests placed since the last scrape are not in the engine's count yet: this
        picker's own are in its virtual queue, a peer's show at the next scrape. Without
        that count (not exported, or the scrape is stale) every in-flight token counts, as
        with `untilEnd`, and `floor_fallbacks` says so. `tokens`: the in-flight tokens to
        count (the peers' share drained or not). `count`: False for an explanation, which
        re-runs a prediction already scored (and counted)."""
        n = st.inflight_requests
        if not self._until_first_token:
            return tokens
        if st.prefilling is None or st.is_stale:
            if count:
                self.floor_fallbacks += 1
            if address not in self._fallen_back and len(self._fallen_back) < 1024:
                self._fallen_back.add(address)
                log.warning(
                    "predicted-ttft-scorer: %s gives no fresh first-token and finished counts "
                    "(vllm:time_to_first_token_seconds, vllm:request_success_total): its "
                    "in-flight requests count as prefill until they end",
                    address,
                )
            return tokens
        if n > st.prefilling:
            return tokens * st.prefilling / n
        return tokens

    def eviction_cost(self, req: InferenceRequest, c: Candidate) -> float:
        """Seconds of future recompute that placing this request on `c` causes: the resident
        tokens its uncached part evicts, times the measured chance one is needed again,
        over `c`'s prefill speed. 0 while `c`'s cache has room or its size is unknown."""
        st = c.state
        if not (self._reuse and st.kv_blocks and st.kv_block_size):
            return 0.0
        work = uncached_tokens(req, c)
        # In approximate mode `_written` and `work` are estimates and the capacity engine
        # tokens, so the charge starts at the capacity ratio of the real fill (~0.78 on the
        # routing bench's text); in precise mode the units agree and it starts later. That
        # early charge is most of what keeps approximate ahead of precise on text at 16
        # req/s; converting the capacity to estimates lost approximate the same (hit 61-62%
        # against 65.5%, TTFT p90 2.2 s against 1.74 s; bench/RESULTS.md, precise16).
        room = st.kv_blocks * st.kv_block_size - self._written.get(c.endpoint.address, 0.0)
        evicted = min(work, max(0.0, work - room))
        return self._reuse * evicted / self._tps(c)

    def spill_charge(
        self, req: InferenceRequest, cands: Sequence[Candidate], queues: Sequence[float]
    ) -> tuple[list[float], float]:
        """`spillCost: fleetBusy`: seconds charged to each candidate for the prefill it adds
        beyond the candidate holding most of the prompt, and the busy share that weighed it.
        `queues`: each candidate's predicted queue ahead (seconds). The share of candidates
        with work queued is the chance a lane is busy when the added prefill runs, so it is
        the share of that prefill later requests wait behind: ~0 on an idle fleet, the whole
        of it when every lane is busy. Measured on the candidates the filters left, from
        the predictions just made (no state, O(candidates)); the extra prefill is counted
        at each candidate's own speed, as its queue is."""
        work = [uncached_tokens(req, c) for c in cands]
        least = min(work)
        busy = sum(q > _BUSY_S for q in queues) / len(cands)
        return [busy * (w - least) / self._tps(c) for c, w in zip(cands, work, strict=True)], busy

    def holder_margin(
        self, req: InferenceRequest, cands: Sequence[Candidate], added: Sequence[float]
    ) -> list[float]:
        """Seconds of each candidate's KV-fit wait (`added`: what it added to the prediction)
        not counted: up to `kvFitMargin` at a candidate that holds more of the prompt than
        the one holding least (the part that distinguishes this request, not a header every
        server has), none elsewhere. A request then leaves its prefix holder for the KV
        wait only when that wait exceeds the recompute elsewhere by the margin. Why one: the
        wait at the holder is predicted, the wait where it goes often is not (a candidate
        predicted to have room still made a request wait > 20 ms in 14-27% of the requests
        at seed 2 of the tenants knee, 0.34-0.37 s median: 0.05-0.09 s a request on
        average), and the move writes the prompt a second time. Counted whole, the wait
        moved 3-4 requests a run off their holders there, and seed 2 lost hit ratio
        (bench/RESULTS.md, issue 14, twentieth session)."""
        if not (self._kv_margin and any(added)):
            return [0.0] * len(cands)
        least = min(c.prefix_blocks for c in cands)
        return [
            min(kv, self._kv_margin) if c.prefix_blocks > least else 0.0
            for c, kv in zip(cands, added, strict=True)
        ]

    @property
    def mean_prefill(self) -> float | None:
        """The mean placed prefill (estimated uncached tokens; None before any placement)."""
        return self._mean_prefill

    def _pool_peers(self) -> None:
        """`meanPlacements: fleet`: the peers' placements since the last decision into the
        mean placed prefill, as that many placements of their mean size (their order among
        this replica's own within the interval is not known; the moving average barely
        cares)."""
        source = self.peer_placements
        if source is None:
            return
        n, t = source()
        n0, t0 = self._pooled_upto
        self._pooled_upto = (n, t)
        k, tokens = n - n0, t - t0
        if self.fleet_folded is not None and self.fleet_folded():
            return  # folded: `fold` put them in the mean already
        if k <= 0 or tokens < 0 or tokens > k * _MAX_PROMPT_TOKENS:
            return
        size = tokens / k
        mean = self._mean_prefill
        # k steps of the moving average towards the same value.
        self._mean_prefill = size if mean is None else size + (mean - size) * _KEEP**k
        self.mean_pooled += k

    def _pool_written_tokens(self, cands: Sequence[Candidate]) -> None:
        """`writtenPlacements: fleet`: what the peers placed on each candidate since it was
        last scored here, into the tokens written there (endpoints not scored keep theirs
        until they are: only a candidate's count is ever read)."""
        arrivals = self.peer_arrivals
        if arrivals is None:
            return
        folded = self.fleet_folded is not None and self.fleet_folded()
        for c in cands:
            address = c.endpoint.address
            placed = arrivals.placed(address)
            before = self._written_upto.get(address, 0.0)
            self._written_upto[address] = placed
            # Less than before: the count was forgotten (an idle endpoint in a churning
            # pool) and starts again; folded: `fold` wrote the peers' placements already.
            if placed > before and not folded:
                self._written[address] = self._written.get(address, 0.0) + placed - before
                self.written_pooled += placed - before

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        if self._pool_mean:
            self._pool_peers()
        if self._pool_written:
            self._pool_written_tokens(cands)
        now = self._clock()
        cost = []
        added = []
        queues = []
        for c in cands:
            t, kv = self._predict(req, c, now)
            cost.append(t + self.eviction_cost(req, c))
            added.append(kv)
            if self._spill_cost:
                queues.append(t - uncached_tokens(req, c) / self._tps(c) - _FLOOR_S)
        margin = self.holder_margin(req, cands, added)
        if any(margin):
            cost = [t - m for t, m in zip(cost, margin, strict=True)]
            added = [kv - m for kv, m in zip(added, margin, strict=True)]
        if self._spill_cost:
            charge, _ = self.spill_charge(req, cands, queues)
            if any(charge):
                self.spill_charged += 1
                before = cost.index(min(cost))
                cost = [t + ch for t, ch in zip(cost, charge, strict=True)]
                if cost.index(min(cost)) != before:
                    self.spill_changed += 1
        best = min(cost)
        if any(added):
            without = [t - kv for t, kv in zip(cost, added, strict=True)]
            if cost.index(best) != without.index(min(without)):
                self.kv_fit_changed += 1
        return [best / t for t in cost]

    def explain(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[dict[str, float]]:
        """Per candidate, the prediction's terms (seconds: the virtual queue, the in-flight
        and scraped-waiting floors that applied, the queue they made, the uncached prefill,
        the eviction cost, the total; with `kvFit: wait`, the KV wait and the part of it a
        holder's margin left out of the score) and the inputs they came from (scraped waiting and
        running, KV usage, in-flight requests and tokens, speed, the mean placed prefill, the
        reuse share and the tokens counted written there, the eviction cost's inputs)."""
        now = self._clock()
        out = []
        predictions = []
        for c in cands:
            terms: dict[str, float] = {}
            predicted, kv = self._predict(req, c, now, terms)
            predictions.append((terms, predicted, kv))
        margin = self.holder_margin(req, cands, [kv for _, _, kv in predictions])
        if self._spill_cost:
            queues = [terms["queue_s"] for terms, _, _ in predictions]
            charge, busy = self.spill_charge(req, cands, queues)
        else:
            charge, busy = [0.0] * len(cands), 0.0
        for c, (terms, predicted, _), m, ch in zip(cands, predictions, margin, charge, strict=True):
            st = c.state
            if self._kv_fit:
                terms["kv_fit_margin_s"] = m
            if self._spill_cost:
                terms["spill_cost_s"] = ch
                terms["fleet_busy"] = busy
            terms |= {
                "eviction_s": self.eviction_cost(req, c),
                "predicted_s": predicted,
                "tps": self._tps(c),
                "waiting": st.waiting,
                "running": st.running,
                "kv_usage": st.kv_usage,
                "inflight_requests": st.inflight_requests,
                "inflight_tokens": st.inflight_tokens,
                "stale": float(st.is_stale),
                "mean_prefill": self._mean_prefill or 0.0,
                "reuse_share": self._reuse,
                "written": self._written.get(c.endpoint.address, 0.0),
            }
            out.append(terms)
        return out

    def observe(
        self, req: InferenceRequest, cands: Sequence[Candidate], decision: Decision
    ) -> None:
        if not decision.endpoints:
            return
        addr = decision.primary.address
        chosen = next((c for c in cands if c.endpoint.address == addr), None)
        if chosen is None:
            return
        now = self._clock()
        work = uncached_tokens(req, chosen)
        seconds = work / self._tps(chosen)
        self._record(addr, work, req.prompt_tokens, seconds, now, now)
        if self._kv_fit and not self._prefix_held and req.block_keys:
            running = self._running_keys.get(addr)
            if running is None:
                running = self._running_keys[addr] = deque(maxlen=_MAX_LIVE)
            running.append((self._busy_until[addr], req.block_keys))
        if self.on_placed is not None:
            self.on_placed(addr, work, req.prompt_tokens, seconds)
        if len(self._busy_until) > 4 * len(cands) + 64:
            # Endpoints that left: forget the drained ones.
            self._busy_until = {a: t for a, t in self._busy_until.items() if t > now}
            live = self._busy_until.keys() | {c.endpoint.address for c in cands}
            self._written = {a: n for a, n in self._written.items() if a in live}
            # Kept while the exchange still counts the peers' placements there: dropped, an
            # endpoint coming back would be credited everything they ever placed on it.
            arrivals = self.peer_arrivals
            self._written_upto = {
                a: n for a, n in self._written_upto.items()
                if a in live or (arrivals is not None and arrivals.placed(a) > 0)
            }  # fmt: skip
            self._live = {a: q for a, q in self._live.items() if a in live}
            self._running_keys = {a: q for a, q in self._running_keys.items() if a in live}

    def _record(
        self, addr: str, work: float, prompt_tokens: int, seconds: float, at: float, now: float
    ) -> None:
        """A placement of `work` uncached tokens (of `prompt_tokens`) on `addr` made at `at`,
        taking `seconds` of prefill there: it queues behind what `addr` had, fills its cache."""
        start = max(at, self._busy_until.get(addr, at))
        end = self._busy_until[addr] = min(start + seconds, now + _MAX_QUEUE_S)
        if self._kv_fit:
            live = self._live.get(addr)
            if live is None:
                live = self._live[addr] = deque(maxlen=_MAX_LIVE)
            live.append((at, work, end))
        mean = self._mean_prefill
        self._mean_prefill = work if mean is None else mean + (1.0 - _KEEP) * (work - mean)
        self._written[addr] = self._written.get(addr, 0.0) + work
        if prompt_tokens > 0:
            reused = max(0.0, 1.0 - work / prompt_tokens)
            self._reuse += 0.05 * (reused - self._reuse)

    def fold(
        self, address: str, work: float, prompt_tokens: int, seconds: float, age_s: float
    ) -> bool:
        """A peer replica's placement on `address` (one `on_placed` gave there), made `age_s`
        ago: applied as if placed here. False (nothing applied) for values no placement has:
        not finite, negative, more uncached tokens than the prompt, a prompt or a prefill
        beyond the bounds above. The caller checks `address` is in the pool."""
        try:
            work, seconds, age_s = float(work), float(seconds), float(age_s)
            prompt = int(prompt_tokens)
        except (TypeError, ValueError, OverflowError):
            return False
        if not (math.isfinite(work) and math.isfinite(seconds) and math.isfinite(age_s)):
            return False
        if not (0 <= work <= prompt <= _MAX_PROMPT_TOKENS and 0 <= seconds <= _MAX_QUEUE_S):
            return False
        now = self._clock()
        self._record(address, work, prompt, seconds, now - min(max(age_s, 0.0), 1.0), now)
        return True

    def view(self) -> dict[str, tuple[float, float]]:
        """Per endpoint this scorer has placed on (or folded a placement for): seconds of
        prefill it predicts queued there now, and tokens it counts written to its cache."""
        now = self._clock()
        return {
            a: (max(0.0, self._busy_until.get(a, now) - now), self._written.get(a, 0.0))
            for a in self._busy_until.keys() | self._written.keys()
        }


def _load(c: Candidate) -> int:
    """Requests on the endpoint: those the pickers placed, or what its fresh metrics show
    running and waiting when more (another client's work, sent behind the pickers' back:
    counting only placements made a busy server look emptiest and bounded the idle one)."""
    st = c.state
    if st.is_stale:
        return st.inflight_requests
    return max(st.inflight_requests, st.running + st.waiting)


class BoundedLoadFilter:
    """Consistent hashing with bounded loads, applied to cache affinity: an endpoint may take
    the request only while its in-flight requests stay under `(1 + epsilon)` times the
    fleet's mean plus one, so a prefix group that outgrows one server spills to a second
    (which then holds a replica of the hot prefix) instead of piling up where the prefix
    first landed. In-flight counts last until requests end and are shared by every replica,
    so replicas apply the same bound. Never removes every candidate.

    With a `bounded-sessions-filter` in the same config, a later turn of a live session is
    not bounded here: moving it recomputes its whole tail, which `predicted-ttft-scorer`
    weighs against the wait; a count of in-flight requests cannot. (Unless its endpoint
    restarted, left or cleared its cache since its last turn: the tail is gone, moving
    costs nothing.)

    ```yaml
    - type: bounded-load-filter
      parameters: {epsilon: 0.25}
    ```
    """

    type_name: ClassVar[str] = "bounded-load-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        epsilon: Annotated[float, msgspec.Meta(ge=0.0)] = 0.25

    def __init__(self, params: Params | None = None) -> None:
        self._eps = (params or self.Params()).epsilon
        self._sessions: BoundedSessionsFilter | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        self._sessions = next(
            (p for p in plugins.values() if isinstance(p, BoundedSessionsFilter)), None
        )

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        if len(cands) < 2:
            return cands
        if self._sessions is not None and self._sessions.continues(req, cands):
            return cands
        loads = [_load(c) for c in cands]
        bound = (1.0 + self._eps) * (sum(loads) + 1) / len(cands) + 1.0
        keep = [c for c, n in zip(cands, loads, strict=True) if n <= bound]
        return keep or cands
