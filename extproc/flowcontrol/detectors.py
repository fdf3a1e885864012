"""Saturation detectors: one number for the whole pool, >= 1.0 meaning "saturated: hold new
work". Names and parameters are llm-d's (`utilization-detector`, `concurrency-detector`).

A detector sees each endpoint's `EndpointState` (scraped figures merged with in-flight
counts, fleet-wide when in-flight counts are shared through Redis) plus the work this
process has released from its queue but not yet placed (`pending_*`), which the scraped and
in-flight figures cannot show yet; without it one capacity tick would release the whole queue.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol

import msgspec

from extproc.core import EndpointState

_Pos = Annotated[float, msgspec.Meta(gt=0)]
_PosInt = Annotated[int, msgspec.Meta(gt=0)]
_NonNeg = Annotated[float, msgspec.Meta(ge=0)]

log = logging.getLogger("extproc.flowcontrol")


class SaturationDetector(Protocol):
    def saturation(
        self, states: Sequence[EndpointState], pending_requests: int, pending_tokens: int
    ) -> float:
        """Pool saturation: 0 idle, 1.0 at the configured ideal capacity."""
        ...


class EndpointDetector(SaturationDetector, Protocol):
    """A detector that can also judge one endpoint: its saturation with `extra_requests` /
    `extra_tokens` more placed on it (work released to it and a request that would be).
    Per-endpoint admission (`flow_control.admit_per_endpoint`) releases a request only
    where this stays under the band's ceiling."""

    def endpoint_saturation(
        self, state: EndpointState, extra_requests: int, extra_tokens: int
    ) -> float: ...


class UtilizationDetector:
    """`utilization-detector` (llm-d's default): per endpoint the larger of waiting-queue
    depth / queueDepthThreshold and KV-cache use / kvCacheUtilThreshold (a roofline); the
    pool's saturation is the average. Endpoints whose scraped figures are stale (older than
    metricsStalenessThreshold, or never scraped) count as fully saturated, so an unobservable
    endpoint never attracts released work. Needs `state.scrape`."""

    type_name = "utilization-detector"
    # Scraped figures show a placed request only at a later scrape: the controller keeps
    # released work pending for a while after placement (see FlowController).
    sees_placement = False
    # The scraped KV use grows by a request's output as it is generated: work released to
    # an endpoint counts prompt + output (FlowRequest.counted_tokens).
    counts_output = True

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        queueDepthThreshold: _PosInt = 5
        kvCacheUtilThreshold: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
        metricsStalenessThreshold: str = "200ms"
        headroom: _NonNeg = 0.0

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()
        from extproc.flowcontrol.config import parse_duration

        self.stale_after_s = parse_duration(self.params.metricsStalenessThreshold)

    def saturation(
        self, states: Sequence[EndpointState], pending_requests: int, pending_tokens: int
    ) -> float:
        if not states:
            return 1.0
        p = self.params
        fresh = [s for s in states if s.age_s is not None and s.age_s <= self.stale_after_s]
        total = float(len(states) - len(fresh))  # unobservable endpoints count as full
        if not fresh:
            return total / len(states)
        # Released work the next scrape will show, spread over the observable endpoints.
        # Where the engine's KV size is known it lands in KV first and only what does not fit
        # waits; otherwise every released request is counted as waiting (an overestimate
        # that holds back the next release until the scrape shows where it went).
        capacity = [(s.kv_blocks or 0) * (s.kv_block_size or 0) for s in fresh]
        if all(capacity):
            share = pending_tokens / len(fresh)
            per_req = pending_tokens / pending_requests if pending_requests else 0.0
            for s, cap in zip(fresh, capacity, strict=True):
                kv = s.kv_usage + share / cap
                overflow = max(0.0, kv - 1.0) * cap / per_req if per_req else 0.0
                waiting = s.waiting + overflow
                total += max(waiting / p.queueDepthThreshold, min(kv, 1.0) / p.kvCacheUtilThreshold)
            return total / len(states)
        for s in fresh:
            total += max(s.waiting / p.queueDepthThreshold, s.kv_usage / p.kvCacheUtilThreshold)
        return (total + pending_requests / p.queueDepthThreshold) / len(states)

    def endpoint_saturation(
        self, state: EndpointState, extra_requests: int, extra_tokens: int
    ) -> float:
        """One endpoint with extra work on it, counted as `saturation` counts pending work
        (into KV where its size is known, what does not fit waits); stale = full."""
        p = self.params
        if state.age_s is None or state.age_s > self.stale_after_s:
            return math.inf  # unobservable: never a place to release work to
        cap = (state.kv_blocks or 0) * (state.kv_block_size or 0)
        if cap:
            kv = state.kv_usage + extra_tokens / cap
            per_req = extra_tokens / extra_requests if extra_requests else 0.0
            overflow = max(0.0, kv - 1.0) * cap / per_req if per_req else 0.0
            waiting = state.waiting + overflow
            return max(waiting / p.queueDepthThreshold, min(kv, 1.0) / p.kvCacheUtilThreshold)
        waiting = state.waiting + extra_requests
        return max(waiting / p.queueDepthThreshold, state.kv_usage / p.kvCacheUtilThreshold)


class ConcurrencyDetector:
    """`concurrency-detector`: in-flight work placed by the pickers against an ideal capacity
    per endpoint. `concurrencyMode`: `requests` (in-flight requests / maxConcurrency),
    `tokens` (in-flight tokens / maxTokenConcurrency; our in-flight tokens are the uncached
    prompt tokens placed), `hybrid` (per endpoint the larger of the two). Pool saturation is
    the average over endpoints. Works without scraping; fleet-wide when in-flight counts are
    shared (`state.shared_inflight`).

    Two extproc parameters (not llm-d's) make `tokens` track the engine's KV exactly:
    `outputTokens` counts each in-flight request's output besides its prompt (vLLM-style
    engines hold KV for prompt + output, and a simulator or engine that reserves max_tokens
    at admission holds it all from the start); `kvCacheFraction` > 0 takes each endpoint's
    token ceiling from its own KV size (`vllm:cache_config_info`: blocks x block size)
    times the fraction instead of the hand-set `maxTokenConcurrency`. An endpoint whose KV
    size is not known yet counts as saturated (never as empty): logged once, and counted in
    `unknown_capacity` (exported as `extproc_flow_detector_unknown_capacity_endpoints`).

    `kvCacheFraction` is a ratio of the picker's estimate (estimated tokens per engine KV
    token) in the unit of the configured `parse.bytes_per_token`: when approximate mode's
    calibration changes it, every estimate becomes `factor` times what it was and so does
    the fraction (`units_changed`; `kv_fraction` is the effective one), or the ceiling
    would admit `factor` times less (or more) than the operator's fraction meant. The
    counts the operator sets in tokens (`maxTokenConcurrency`, `outputTokens`) stay as
    given."""

    type_name = "concurrency-detector"
    sees_placement = True  # in-flight counts move at placement

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        maxConcurrency: _PosInt = 100
        headroom: _NonNeg = 0.0
        concurrencyMode: Literal["requests", "tokens", "hybrid"] = "requests"
        maxTokenConcurrency: _PosInt = 1_000_000
        inFlightLoadProducerName: str = ""
        outputTokens: Annotated[int, msgspec.Meta(ge=0)] = 0
        kvCacheFraction: Annotated[float, msgspec.Meta(ge=0, le=2)] = 0.0

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()
        # Endpoints whose KV size was unknown at the last evaluation (kvCacheFraction).
        self.unknown_capacity = 0
        self._warned = False
        # Estimates per estimate of the configured unit: every units change's factor
        # multiplied (runtime state beside the frozen params).
        self.units = 1.0

    @property
    def kv_fraction(self) -> float:
        """Estimated tokens per engine KV token when the ceiling is each server's KV size
        (tokens or hybrid mode with `kvCacheFraction`), else 0: the configured fraction in
        the estimates' present unit."""
        p = self.params
        return p.kvCacheFraction * self.units if p.concurrencyMode != "requests" else 0.0

    def units_changed(self, factor: float) -> None:
        """Token estimates are now `factor` times what they were for the same prompt."""
        if factor > 0:
            self.units *= factor

    @property
    def output_per_request(self) -> int:
        """The output tokens counted per in-flight request (0: output not counted)."""
        return 0 if self.params.concurrencyMode == "requests" else self.params.outputTokens

    @property
    def counts_output(self) -> bool:
        """Whether a placed request's output is counted: without `outputTokens` a request
        is its prompt alone, and so is the room it asks for (FlowRequest.counted_tokens)."""
        return self.output_per_request > 0

    def _token_ceiling(self, s: EndpointState) -> float | None:
        p = self.params
        if not p.kvCacheFraction:
            return float(p.maxTokenConcurrency)
        if s.kv_blocks and s.kv_block_size:
            return p.kvCacheFraction * self.units * s.kv_blocks * s.kv_block_size
        return None

    def saturation(
        self, states: Sequence[EndpointState], pending_requests: int, pending_tokens: int
    ) -> float:
        if not states:
            return 1.0
        p = self.params
        n = len(states)
        if p.concurrencyMode == "requests":
            reqs = sum(s.inflight_requests for s in states) + pending_requests
            return reqs / (n * p.maxConcurrency)
        # Per endpoint (ceilings may differ), pending work spread evenly.
        total = 0.0
        unknown = 0
        for s in states:
            cap = self._token_ceiling(s)
            unknown += cap is None
            toks = s.inflight_tokens + s.inflight_requests * p.outputTokens + pending_tokens / n
            ratio = toks / cap if cap else 1.0
            if p.concurrencyMode == "hybrid":
                ratio = max(ratio, (s.inflight_requests + pending_requests / n) / p.maxConcurrency)
            total += ratio
        self._note_unknown(unknown)
        return total / n

    def endpoint_saturation(
        self, state: EndpointState, extra_requests: int, extra_tokens: int
    ) -> float:
        """One endpoint with extra work on it (`extra_tokens` already include their
        expected output where `counts_output`, as pending work does in `saturation`)."""
        p = self.params
        reqs = state.inflight_requests + extra_requests
        if p.concurrencyMode == "requests":
            return reqs / p.maxConcurrency
        cap = self._token_ceiling(state)
        toks = state.inflight_tokens + state.inflight_requests * p.outputTokens + extra_tokens
        ratio = toks / cap if cap else math.inf  # KV size unknown: saturated
        if p.concurrencyMode == "hybrid":
            ratio = max(ratio, reqs / p.maxConcurrency)
        return ratio

    def _note_unknown(self, unknown: int) -> None:
        self.unknown_capacity = unknown
        if unknown and not self._warned:
            self._warned = True
            log.warning(
                "concurrency-detector: KV size of %d endpoint(s) unknown (no "
                "vllm:cache_config_info scraped); they count as saturated",
                unknown,
            )


DETECTORS: tuple[type[Any], ...] = (UtilizationDetector, ConcurrencyDetector)
