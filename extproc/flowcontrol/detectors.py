"""Saturation detectors: one number for the whole pool, >= 1.0 meaning "saturated: hold new
work". Names and parameters are llm-d's (`utilization-detector`, `concurrency-detector`).

A detector sees each endpoint's `EndpointState` (scraped figures merged with in-flight
counts, fleet-wide when in-flight counts are shared through Redis) plus the work this
process has released from its queue but not yet placed (`pending_*`), which the scraped and
in-flight figures cannot show yet; without it one capacity tick would release the whole queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, Protocol

import msgspec

from extproc.core import EndpointState

_Pos = Annotated[float, msgspec.Meta(gt=0)]
_PosInt = Annotated[int, msgspec.Meta(gt=0)]
_NonNeg = Annotated[float, msgspec.Meta(ge=0)]


class SaturationDetector(Protocol):
    def saturation(
        self, states: Sequence[EndpointState], pending_requests: int, pending_tokens: int
    ) -> float:
        """Pool saturation: 0 idle, 1.0 at the configured ideal capacity."""
        ...


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
        total = 0.0
        for s in states:
            if s.age_s is None or s.age_s > self.stale_after_s:
                total += 1.0
                continue
            total += max(s.waiting / p.queueDepthThreshold, s.kv_usage / p.kvCacheUtilThreshold)
        # Released work lands in some endpoint's waiting queue before the next scrape shows it.
        return (total + pending_requests / p.queueDepthThreshold) / len(states)


class ConcurrencyDetector:
    """`concurrency-detector`: in-flight work placed by the pickers against an ideal capacity
    per endpoint. `concurrencyMode`: `requests` (in-flight requests / maxConcurrency),
    `tokens` (in-flight tokens / maxTokenConcurrency; our in-flight tokens are the uncached
    prompt tokens placed), `hybrid` (per endpoint the larger of the two). Pool saturation is
    the average over endpoints. Works without scraping; fleet-wide when in-flight counts are
    shared (`state.shared_inflight`)."""

    type_name = "concurrency-detector"
    sees_placement = True  # in-flight counts move at placement

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        maxConcurrency: _PosInt = 100
        headroom: _NonNeg = 0.0
        concurrencyMode: Literal["requests", "tokens", "hybrid"] = "requests"
        maxTokenConcurrency: _PosInt = 1_000_000
        inFlightLoadProducerName: str = ""

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def saturation(
        self, states: Sequence[EndpointState], pending_requests: int, pending_tokens: int
    ) -> float:
        if not states:
            return 1.0
        p = self.params
        n = len(states)
        reqs = (sum(s.inflight_requests for s in states) + pending_requests) / (
            n * p.maxConcurrency
        )
        toks = (sum(s.inflight_tokens for s in states) + pending_tokens) / (
            n * p.maxTokenConcurrency
        )
        if p.concurrencyMode == "requests":
            return reqs
        if p.concurrencyMode == "tokens":
            return toks
        # hybrid: per endpoint the more constraining ratio, averaged; pending spread evenly.
        total = 0.0
        for s in states:
            total += max(
                (s.inflight_requests + pending_requests / n) / p.maxConcurrency,
                (s.inflight_tokens + pending_tokens / n) / p.maxTokenConcurrency,
            )
        return total / n


DETECTORS: tuple[type, ...] = (UtilizationDetector, ConcurrencyDetector)
