"""The router's admission hook: turns a parsed request into a flow request (who, how urgent,
how many tokens), waits for the controller, and maps a shed request to the answer the client
gets: 429 with `x-llm-d-request-dropped-reason` and `retry-after`.

Also owns the periodic work (TTL sweep, capacity re-check, objectives reload, shared-state
exchange) and the flow-control metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from extproc.core import EndpointState, InferenceRequest
from extproc.errors import BadRequest, Overloaded
from extproc.flowcontrol import spike_auto
from extproc.flowcontrol.config import FlowConfig
from extproc.flowcontrol.controller import (
    REJECTED_SATURATED,
    FlowController,
    FlowRejected,
    FlowRequest,
    FlowStats,
    Ticket,
)
from extproc.flowcontrol.engine_blocks import EngineBlocks
from extproc.flowcontrol.engine_priority import EnginePriority
from extproc.flowcontrol.eviction import EVICTED
from extproc.flowcontrol.objectives import (
    DEFAULT_FAIRNESS_ID,
    Objectives,
    first_header,
)
from extproc.flowcontrol.output_scale import OutputScale
from extproc.flowcontrol.refill import PredictedRefill, StartedRefill
from extproc.flowcontrol.reserve import BandPrior
from extproc.protocol import FAIRNESS_HEADERS, TTFT_SLO_HEADERS

log = logging.getLogger("extproc.flowcontrol")

_MAX_FAIRNESS_ID = 128
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Shed(Overloaded):
    """A request flow control did not admit: 429 with its reason and a retry hint."""

    def __init__(self, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.code = reason
        headers = {"retry-after": str(retry_after_s)} if retry_after_s else {}
        self.extra_headers = MappingProxyType(headers)


def _kv_fraction(detector: object) -> float:
    """The detector's estimated tokens per engine KV token in the estimates' present unit
    (the concurrency detector with `kvCacheFraction`), 0 for a detector without one."""
    return float(getattr(detector, "kv_fraction", 0.0))


class Admission:
    def __init__(
        self,
        config: FlowConfig,
        states: Callable[[], Sequence[EndpointState]],
        *,
        objectives: Objectives | None = None,
        registry: CollectorRegistry | None = None,
        controller: FlowController | None = None,
        rand: Callable[[], float] = random.random,
        endpoints: Callable[[], Sequence[tuple[str, EndpointState]]] | None = None,
        prefill_speed: Callable[[], float | None] | None = None,
    ) -> None:
        """`states`: the pool's endpoint states now; `endpoints`: the same with addresses,
        for per-endpoint admission (`admit_per_endpoint`; None: by the pool alone);
        `prefill_speed`: tokens/s of a prefill alone, measured (sizes the reserve)."""
        s = config.settings
        spike = spike_auto.resolve(
            s.reserve_spike_joint,
            s.reserve_spike_quantile,
            s.reserve_refill_credit,
            spike_s=s.reserve_spike_s,
        )
        spike_auto.say(
            spike, s.reserve_spike_joint, s.reserve_spike_quantile, s.reserve_refill_credit
        )
        self.spike_settings = spike
        self._states = states
        self._rand = rand
        self.config = config
        self.settings = s
        self.objectives = objectives or Objectives(s.objectives_file)
        if s.reserve_prior and not (s.admit_per_endpoint and s.reserve_for_higher_bands):
            log.warning(
                "flow_control.reserve_prior has no effect without admit_per_endpoint and "
                "reserve_for_higher_bands"
            )
        if s.waiting_claims_room and not s.admit_per_endpoint:
            log.warning("flow_control.waiting_claims_room has no effect without admit_per_endpoint")
        if (
            s.reserve_quantile or s.reserve_rate_quantile or s.reserve_refill_s or s.reserve_spike_s
        ) and not (s.admit_per_endpoint and s.reserve_for_higher_bands):
            log.warning(
                "flow_control.reserve_quantile / reserve_rate_quantile / reserve_refill_s / "
                "reserve_spike_s have "
                "no effect without "
                "admit_per_endpoint and reserve_for_higher_bands"
            )
        if s.reserve_refill_floor and not s.reserve_refill_s:
            log.warning("flow_control.reserve_refill_floor has no effect without reserve_refill_s")
        if s.reserve_spike_joint is True and not s.reserve_spike_s:
            log.warning("flow_control.reserve_spike_joint has no effect without reserve_spike_s")
        # The prior's prompt (what a server prefills) is its request less the output
        # counted per request. Its size and rate are taken in the unit the band's own
        # history is noted in (FlowRequest.counted_tokens): without the detector counting
        # output, the prompt alone, and the rate by the same share.
        counts_output = bool(getattr(config.detector, "counts_output", True))
        priors = {}
        for p, rp in s.reserve_prior.items():
            prompt = max(0, rp.request_tokens - s.expected_output_tokens)
            share = 1.0 if counts_output else prompt / rp.request_tokens
            priors[p] = BandPrior(
                tokens=rp.request_tokens if counts_output else prompt,
                prompt=prompt,
                rate=rp.tokens_per_s * share,
                prefill_s=rp.prefill_s,
            )
        self.controller = controller or FlowController(
            detector=config.detector,
            states=states,
            band=config.band,
            ttl_s=config.ttl_s,
            max_requests=config.max_requests,
            max_bytes=config.max_bytes,
            weights=s.fairness_weights,
            usage_half_life_s=s.usage_half_life_s,
            usage_limit=config.usage_limit,
            priorities=tuple(config.bands),
            visibility_s=s.placement_visibility_s,
            eviction=config.eviction,
            endpoints=endpoints if s.admit_per_endpoint else None,
            reserve=s.reserve_for_higher_bands,
            prefill_speed=prefill_speed,
            reserve_priors=priors,
            reserve_quantile=s.reserve_quantile,
            reserve_rate_quantile=s.reserve_rate_quantile,
            reserve_refill_s=s.reserve_refill_s,
            reserve_refill_credit=spike.credit,
            reserve_refill_floor=s.reserve_refill_floor,
            reserve_spike_s=s.reserve_spike_s,
            reserve_spike_quantile=spike.quantile,
            reserve_spike_joint=spike.joint,
            gate=config.gate,
            waiting_claims_room=s.waiting_claims_room,
            dispatch_on_end=s.dispatch_on_end,
            engine_blocks=s.count_engine_blocks,
            engine_blocks_lower_bands=s.engine_blocks_lower_bands == "blocks",
            evict_per_endpoint=s.evict_per_endpoint,
        )
        self.shared = None  # a SharedFlowState, set by the app when Redis is configured
        # The unit outputs are counted in: configured, or measured by calibration (the app
        # feeds it at every scrape: `output_scale.measured(ratios)`).
        self.output_scale = OutputScale(s.output_token_scale)
        # Each request as its engine holds it, for the room checks (count_engine_blocks; fed
        # at every scrape like the output scale: `engine_blocks.measured(ratios, block)`).
        fraction = _kv_fraction(config.detector)
        self.engine_blocks = EngineBlocks(s.count_engine_blocks, fraction)
        if s.count_engine_blocks and not s.admit_per_endpoint:
            log.warning("flow_control.count_engine_blocks has no effect without admit_per_endpoint")
        # The band sent to the engine as its priority (None: off); `true` is the body form
        # (the setting's original, boolean spelling).
        via = s.engine_priority
        self.engine_priority = (
            EnginePriority(registry, "body" if via is True else via) if via else None
        )
        self.wait_seconds = Histogram(
            "extproc_flow_queue_wait_seconds",
            "Time admitted requests spent in the flow-control queue, by priority band "
            "(0 for requests admitted at once).",
            ["priority"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )

    def flow_request(self, request: InferenceRequest, uncached_tokens: int) -> FlowRequest:
        h = request.headers
        fairness = first_header(h, FAIRNESS_HEADERS) or DEFAULT_FAIRNESS_ID
        if len(fairness) > _MAX_FAIRNESS_ID:
            raise BadRequest(f"fairness ID longer than {_MAX_FAIRNESS_ID} characters")
        slo = None
        raw = first_header(h, TTFT_SLO_HEADERS)
        if raw is not None:
            try:
                slo = max(0.0, float(raw)) / 1000.0
            except ValueError:
                raise BadRequest("x-llm-d-slo-ttft-ms must be a number of milliseconds") from None
        # The output counted: the configured expectation, or the request's own cap when it
        # is lower (it cannot produce more). Not the cap when higher: clients set generous
        # caps, and vLLM allocates KV as tokens are generated, not for max_tokens up front.
        out = self.settings.expected_output_tokens
        if request.max_output_tokens is not None:
            out = min(out, request.max_output_tokens)
        # In the prompt estimate's units (output_token_scale): a count of real tokens added
        # to an estimate that runs 1.28x over them made a server of short prompts, whose
        # output is a larger part of their KV, fuller than counted (bench/RESULTS.md).
        scale = self.output_scale.value
        out = round(out * scale)
        uncached = max(0, uncached_tokens)
        return FlowRequest(
            fairness_id=fairness,
            priority=self.objectives.priority(h),
            tokens=uncached + out,
            body_bytes=request.body_bytes,
            slo_ttft_s=slo,
            output_tokens=out,
            engine_tokens=self.engine_blocks.tokens(uncached, out, scale),
        )

    async def admit(self, request: InferenceRequest, uncached_tokens: int) -> Ticket:
        flow = self.flow_request(request, uncached_tokens)
        if self.config.admitters:
            states = self._states()
            for admitter in self.config.admitters:
                if not admitter.admit(flow.priority, states, self._rand):
                    self.controller.stats.count(flow, "rejected_admitter")
                    raise Shed(
                        REJECTED_SATURATED,
                        "sheddable request refused under load",
                        self.settings.retry_after_s,
                    )
        try:
            ticket = await self.controller.admit(flow)
        except FlowRejected as exc:
            log.info(
                "shed",
                extra={
                    "request_id": request.request_id,
                    "reason": exc.reason,
                    "priority": flow.priority,
                    "fairness_id": flow.fairness_id,
                },
            )
            raise Shed(exc.reason, exc.message, self.settings.retry_after_s) from None
        self.wait_seconds.labels(str(flow.priority)).observe(ticket.waited_s)
        return ticket

    def units_changed(self, factor: float) -> None:
        """Token estimates are now `factor` times what they were for the same prompt
        (approximate mode's calibration changed its bytes per token; the router rescales
        the in-flight prompts). What is a ratio of the estimate follows: the detector's
        `kvCacheFraction` (each server's ceiling), count_engine_blocks' fraction, prior and
        ratio, and the output token scale. What the operator sets as a count of tokens
        stays as given (`expected_output_tokens`, `maxTokenConcurrency`, `outputTokens`,
        `maxPrefillTokens`, reserve priors), as do the figures that age out on their own
        (fairness usage, the reserve's request history, each ticket's counts: what it took
        is what it gives back)."""
        if factor <= 0:
            return
        detector = self.controller.detector
        follow = getattr(detector, "units_changed", None)
        if follow is not None:
            follow(factor)
        self.engine_blocks.units_changed(factor)
        self.output_scale.units_changed(factor)
        fraction = _kv_fraction(detector)
        log.info(
            "flow control: token estimates now %.3gx what they were for the same prompt; "
            "kvCacheFraction %s, output token scale %.3f",
            factor,
            f"{fraction:.3f} in the new unit" if fraction else "not used",
            self.output_scale.value,
        )

    def evicted_error(self) -> Shed:
        """What an evicted request's stream answers (flowcontrol/eviction.py)."""
        return Shed(
            EVICTED,
            "evicted to make room for higher-priority work",
            self.settings.retry_after_s,
        )

    def placed(self, ticket: Ticket, address: str = "") -> None:
        self.controller.placed(ticket, address)

    def release(self, ticket: Ticket, *, output_held: bool = False, cuttable: bool = False) -> None:
        """`output_held`: its in-flight count is held past the ticket; `ended` follows.
        `cuttable`: it stays an eviction candidate; `stream_ended` follows."""
        self.controller.release(ticket, output_held=output_held, cuttable=cuttable)

    def stream_ended(self, ticket: Ticket) -> None:
        """The stream of a ticket released `cuttable` ended."""
        self.controller.stream_ended(ticket)

    def ended(self, ticket: Ticket) -> None:
        """The request is over on its server (its in-flight count released)."""
        self.controller.ended(ticket)

    async def run(self) -> None:
        """Tick: expire, decay, re-check capacity; reload objectives about once a second."""
        tick = self.settings.tick_s
        every = max(1, int(1.0 / tick))
        n = 0
        while True:
            self.controller.tick()
            n += 1
            if n % every == 0:
                self.objectives.refresh()
            await asyncio.sleep(tick)

    def close(self) -> None:
        self.controller.close()

    def collect(self):
        fc = self.controller
        q = gauge(
            "extproc_flow_queue_requests",
            "Requests waiting in the flow-control queue, by priority band and fairness ID.",
            ["priority", "fairness_id"],
        )
        b = gauge(
            "extproc_flow_queue_bytes",
            "Body bytes waiting in the flow-control queue, by priority band.",
            ["priority"],
        )
        per_band: dict[int, int] = {}
        for (p, f), (n, nbytes) in fc.queued().items():
            q.add_metric([str(p), fc.stats.label(f)], n)
            per_band[p] = per_band.get(p, 0) + nbytes
        for p, nbytes in per_band.items():
            b.add_metric([str(p)], nbytes)
        yield q
        yield b
        u = gauge(
            "extproc_flow_fairness_served_tokens",
            "Tokens this replica dispatched per fairness ID, decayed with usage_half_life_s: "
            "the usage weighted-token fairness compares (with the peers' published figures); "
            "a request cut by eviction is taken back out.",
            ["fairness_id"],
        )
        for label, v in _by_label(fc.stats, fc.served).items():
            u.add_metric([label], v)
        yield u
        ps = gauge(
            "extproc_flow_program_service_tokens",
            "Attained service per program (fairness ID) that program-aware-fairness compares: "
            "input tokens + 2 x output tokens dispatched, decayed with lasHalfLifeSeconds; a "
            "request cut by eviction is taken back out.",
            ["fairness_id"],
        )
        for label, v in _by_label(fc.stats, fc.program_service()).items():
            ps.add_metric([label], v)
        yield ps
        o = gauge(
            "extproc_flow_oldest_wait_seconds",
            "How long the oldest queued request of each band has waited.",
            ["priority"],
        )
        for p, w in fc.oldest_wait().items():
            o.add_metric([str(p)], w)
        yield o
        # Outcome counts and waits are FlowStats fields: server/families.py exports them.
        sat = gauge("extproc_flow_saturation", "Pool saturation by the configured detector.")
        sat.add_metric([], fc.saturation())
        yield sat
        unknown = getattr(fc.detector, "unknown_capacity", None)
        if unknown is not None:
            u = gauge(
                "extproc_flow_detector_unknown_capacity_endpoints",
                "Endpoints the detector counts as saturated because their KV size is unknown.",
            )
            u.add_metric([], unknown)
            yield u
        fraction = _kv_fraction(fc.detector)
        if fraction:
            kf = gauge(
                "extproc_flow_detector_kv_fraction",
                "The concurrency detector's kvCacheFraction in the estimates' present unit "
                "(estimated tokens per engine KV token; each server's token ceiling is this "
                "times its KV size): the configured one times every bytes-per-token change's "
                "factor since start.",
            )
            kf.add_metric([], fraction)
            yield kf
        eb = self.engine_blocks
        if eb.enabled:
            ebu = counter(
                "extproc_flow_engine_blocks_unmeasured",
                "Requests counted by their tokens, not as their engine holds them "
                "(count_engine_blocks), for want of a scraped block size.",
            )
            ebu.add_metric([], eb.unmeasured)
            yield ebu
            ebp = counter(
                "extproc_flow_engine_blocks_prior",
                "Requests counted as their engine holds them at the prior ratio (1 / "
                "kvCacheFraction), for want of calibration's measured one (count_engine_blocks).",
            )
            ebp.add_metric([], eb.prior_counted)
            yield ebp
            ebr = gauge(
                "extproc_flow_engine_blocks_ratio",
                "Engine prompt tokens per estimated token the room checks convert with "
                "(count_engine_blocks; 0 until calibration measured one).",
            )
            ebr.add_metric([], eb.per_estimate or 0.0)
            yield ebr
        os_ = gauge(
            "extproc_flow_output_token_scale",
            "Estimated tokens counted per output token (flow_control.output_token_scale), by "
            "source: configured, measured (auto, from calibration), unmeasured (auto, nothing "
            "measured yet or calibration off: 1.0), exact (precise keys count real tokens).",
            ["source"],
        )
        os_.add_metric([self.output_scale.source], self.output_scale.value)
        yield os_
        ol = counter(
            "extproc_flow_objectives_load_errors",
            "Versions of flow_control.objectives_file that could not be read or parsed (or "
            "its going missing): the last good table stays (logged).",
        )
        ol.add_metric([], self.objectives.load_errors)
        yield ol
        nr = counter(
            "extproc_flow_no_endpoint_room",
            "Dispatch opportunities where the pool was under its ceiling but no endpoint had "
            "room for the next request (per-endpoint admission: it stayed queued).",
        )
        nr.add_metric([], fc.no_room)
        yield nr
        pd = counter(
            "extproc_flow_peer_deferrals",
            "Times a band's free capacity was left to another replica (shared flow state: the "
            "flow next by fleet-wide usage was queued only there), by band; each lasts until "
            "a dispatch here or two share_interval_s.",
            ["priority"],
        )
        for band, n in sorted(fc.deferrals_by_band.items()):
            pd.add_metric([str(band)], n)
        yield pd
        ed = counter(
            "extproc_flow_end_dispatches",
            "Requests' ends (access-log entries) taken as a dispatch opportunity at once while "
            "requests were queued (dispatch_on_end).",
        )
        ed.add_metric([], fc.end_dispatches)
        yield ed
        if fc.evictor is not None:
            ev = counter(
                "extproc_flow_endpoint_evictions",
                "Waiting higher-band requests by per-endpoint eviction outcome "
                "(evict_per_endpoint), each outcome once per request: cut (lower-band requests "
                "were cut for it on the endpoint where it comes closest to fitting, or the next "
                "closest where they make its room), short (it found no endpoint whose lower-band "
                "requests could: none cut; one that later gets a cut counts cut too).",
                ["outcome"],
            )
            for outcome, n in fc.evict_outcomes.items():
                ev.add_metric([outcome], n)
            yield ev
            uc = counter(
                "extproc_flow_eviction_uncuttable",
                "Evictable requests that ran on more than 1.5 s after their ext_proc stream "
                "ended (so nothing could cut them meanwhile): the proxy ends the stream at the "
                "response headers (response body NONE, trailers SKIP; `extproc envoy-config "
                "--response-trailers send` keeps it). Needs the access log (request ends).",
            )
            uc.add_metric([], fc.uncuttable)
            yield uc
        if fc.claims is not None:
            cl = counter(
                "extproc_flow_room_claims",
                "Dispatch opportunities at which a higher-band request waiting for room kept "
                "the endpoint where it comes closest to fitting from its band's newer requests "
                "(waiting_claims_room; one per waiting request).",
            )
            cl.add_metric([], fc.claims.made)
            yield cl
        if fc.reserve_count:
            rt = gauge(
                "extproc_flow_reserved_tokens",
                "Tokens a lower band last had to leave free on one endpoint for higher bands "
                "(reserve_for_higher_bands: the largest recent requests plus the arrival rate "
                "times their prefill time).",
            )
            rt.add_metric([], fc.reserve.last_held)
            yield rt
            if fc.refill is not None:
                rc = gauge(
                    "extproc_flow_reserve_refill_tokens",
                    "Of the reserve, the most any endpoint was let keep less at the last "
                    "sizing: the room it is expected to free within reserve_refill_s "
                    "(tokens of the requests that ended there recently).",
                )
                rc.add_metric([], fc.refill.last_credit)
                yield rc
                if isinstance(fc.refill, PredictedRefill):
                    rp = counter(
                        "extproc_flow_reserve_refill_unpredicted",
                        "Refill credits (reserve_refill_credit: predicted) counted from the "
                        "recent ends' rate: no per-output-token time measured yet.",
                    )
                    rp.add_metric([], fc.refill.unpredicted)
                    yield rp
                if isinstance(fc.refill, StartedRefill):
                    ru = counter(
                        "extproc_flow_reserve_refill_unstarted",
                        "Refill credits (reserve_refill_credit: started) on an endpoint whose "
                        "scrape had no first-token count: its requests' ends predicted from "
                        "their placement instead of their decode's start.",
                    )
                    ru.add_metric([], fc.refill.unstarted)
                    yield ru
            ru = counter(
                "extproc_flow_reserve_rate_unsized",
                "Reserve sizings without the arrival-rate term: no prefill speed measured yet "
                "(the largest recent requests alone were kept free).",
            )
            ru.add_metric([], fc.reserve.rate_unsized)
            yield ru
            rh = counter(
                "extproc_flow_reserve_held",
                "Dispatch opportunities where an endpoint had room for a lower band's request "
                "but the reserve for higher bands kept it there (part of "
                "extproc_flow_no_endpoint_room_total).",
            )
            rh.add_metric([], fc.reserve_held)
            yield rh
            op = gauge(
                "extproc_flow_reserve_on_prior",
                "1 while a band's reserve counts its configured reserve_prior (its own "
                "history is short), 0 once sized from measured history alone.",
                ["priority"],
            )
            for p, on in fc.reserve.on_prior.items():
                op.add_metric([str(p)], 1.0 if on else 0.0)
            yield op
            hist = gauge(
                "extproc_flow_reserve_history_requests",
                "Requests of each band's own history sizing the reserve (trusted alone at 100, "
                "or at 20 with reserve_quantile).",
                ["priority"],
            )
            for p in fc.reserve.bands():
                hist.add_metric([str(p)], fc.reserve.history(p))
            yield hist
            if fc.reserve.spike_s:
                spike = gauge(
                    "extproc_flow_reserve_spike_arrivals",
                    "With reserve_spike_s: arrivals of each band (the peers' included) its "
                    "spike term is sized from; under 20 the band's mean arrival rate stands in.",
                    ["priority"],
                )
                for p in fc.reserve.bands():
                    spike.add_metric([str(p)], fc.reserve.spike_history(p))
                yield spike
        gate = fc.gate
        if gate is not None:
            gh = counter(
                "extproc_flow_prefill_gate_held",
                "Dispatch opportunities where a server had KV room for a lower band's request "
                "but the prefill-gate held it: a higher band is active and no such server "
                "would keep its unfinished prefill under maxPrefillTokens.",
            )
            gh.add_metric([], gate.held)
            yield gh
            gb = counter(
                "extproc_flow_prefill_gate_blind",
                "prefill-gate judgements of a server without fresh first-token and finished "
                "counts: its in-flight prompt tokens counted as unfinished prefill.",
            )
            gb.add_metric([], gate.blind)
            yield gb
            gu = gauge(
                "extproc_flow_prefill_gate_unfinished_tokens",
                "Unfinished prefill tokens per server at the prefill-gate's last judgement.",
                ["endpoint"],
            )
            for addr, toks in gate.last_unfinished.items():
                gu.add_metric([addr], toks)
            yield gu
            if gate.fleet_view and gate.peer_view is not None:
                fv = gauge(
                    "extproc_flow_prefill_gate_fleet_view",
                    "1 while the prefill-gate counts the other replicas' placements (fleetView, "
                    "shared flow state working), 0 while Redis fails: this replica's own only.",
                )
                fv.add_metric([], 1.0 if gate.peer_view else 0.0)
                yield fv
                pp = gauge(
                    "extproc_flow_prefill_gate_peer_placements",
                    "The other replicas' placements not yet seen to finish their prefill, per "
                    "server, at the last exchange (prefill-gate fleetView).",
                    ["endpoint"],
                )
                for addr, n in gate.peer_counts().items():
                    pp.add_metric([addr], n)
                yield pp
        if self.shared is not None:
            # Exchange counts are SharedFlowStats fields: server/families.py exports them.
            d = gauge(
                "extproc_flow_shared_degraded",
                "1 while Redis is failing: flow control is per replica.",
            )
            d.add_metric([], 1.0 if self.shared.degraded else 0.0)
            yield d

    async def aclose(self) -> None:
        if self.shared is not None:
            with contextlib.suppress(Exception):
                await self.shared.aclose()


def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


def _by_label(stats: FlowStats, values: Mapping[str, float]) -> dict[str, float]:
    """Per-fairness-ID figures under their metric labels: the IDs past the label bound
    share one ("other"), so their figures are summed."""
    out: dict[str, float] = {}
    for f, v in values.items():
        label = stats.label(f)
        out[label] = out.get(label, 0.0) + v
    return out
