"""Prefix-cache affinity: score and gate endpoints by how much of a request's prefix they
already hold (from the global KV-block index), and spread requests that hit nowhere."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import msgspec

from extproc.core import Candidate, Decision, InferenceRequest

if TYPE_CHECKING:
    from extproc.scheduling.plugins.latency import PredictedLatencyProducer

_Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


def prefix_fraction(req: InferenceRequest, c: Candidate) -> float:
    """The fraction of the request's blocks this endpoint holds, 0..1 (tier-weighted)."""
    n = len(req.block_keys)
    return min(1.0, c.prefix_blocks / n) if n else 0.0


class PrefixCacheScorer:
    """Prefers endpoints that hold more of the request's prefix: the fraction of the
    request's block keys matched consecutively from the first block (GPU blocks count 1.0,
    offloaded CPU blocks less, see the index tiers).

    The index itself (approximate from routing decisions, or precise from vLLM KV events)
    is configured in the `index` settings, or by llm-d's producer plugins in the same config
    (see docs/llm-d.md); `mode` has no effect (check-config notes it). With
    `matchLengthWeight` w (0..1) the score blends in the matched length:
    w * min(1, matched tokens / `matchLengthScaleTokens`)^2 + (1 - w) * the fraction
    (llm-d's formula).

    ```yaml
    - type: prefix-cache-scorer
    ```
    """

    type_name: ClassVar[str] = "prefix-cache-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        mode: Literal["approximate", "precise", "auto"] = "auto"
        prefix_match_info_producer_name: str | None = None
        match_length_weight: _Fraction = 0.0
        match_length_scale_tokens: Annotated[int, msgspec.Meta(gt=0)] = 8192

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        n = len(req.block_keys)
        if not n:
            return [0.0] * len(cands)
        ratios = [c.prefix_blocks / n if c.prefix_blocks < n else 1.0 for c in cands]
        w = self.params.match_length_weight
        if not w or not req.block_tokens:
            return ratios
        # llm-d's blend: a long absolute match also counts, squared so short ones count little.
        scale = self.params.match_length_scale_tokens
        lengths = [min(1.0, c.prefix_blocks * req.block_tokens / scale) ** 2 for c in cands]
        return [w * m + (1.0 - w) * r for m, r in zip(lengths, ratios, strict=True)]


class PrefixCacheAffinityFilter:
    """Keeps only the endpoints that hold at least `affinityThreshold` of the request's prefix, when
    any does, so a cached conversation sticks where its cache is.

    Stickiness breaks when it would hurt: when the best sticky endpoint's predicted TTFT
    (the prefill work already placed on it, plus this request's uncached tokens, over
    `peakPrefillThroughput` tokens/s, llm-d's default 15928) exceeds the best other
    endpoint's by more than `maxTTFTPenaltyMs`, the request goes to the others instead, so a
    burst on one hot prefix spills over to more endpoints rather than queueing on one. With
    `explorationProbability` the filter lets everything through at random, so the index keeps
    learning.

    `ttftSource: latencyPredictor` takes each endpoint's TTFT from the
    `predicted-latency-producer` (learned from the servers' own histograms, queued work
    included) instead, so no throughput has to be measured by hand; while nothing is learned
    yet the gate cannot judge and stickiness holds. `latencyPredictionInfoProducerName`
    names the producer when there are several.

    ```yaml
    - type: prefix-cache-affinity-filter
      parameters: {affinityThreshold: 0.8, maxTTFTPenaltyMs: 18000, peakPrefillThroughput: 15928}
    - type: prefix-cache-affinity-filter
      parameters: {affinityThreshold: 0.8, maxTTFTPenaltyMs: 5000, ttftSource: latencyPredictor}
    ```
    """

    type_name: ClassVar[str] = "prefix-cache-affinity-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        affinity_threshold: _Fraction = 0.8
        # llm-d spells it with TTFT in capitals, which camel renaming would not produce.
        max_ttft_penalty_ms: Annotated[float, msgspec.Meta(ge=0.0)] = msgspec.field(
            default=18000.0, name="maxTTFTPenaltyMs"
        )
        peak_prefill_throughput: Annotated[float, msgspec.Meta(gt=0.0)] = 15928.0
        exploration_probability: _Fraction = 0.0
        ttft_source: Literal["prefillThroughput", "latencyPredictor"] = msgspec.field(
            default="prefillThroughput", name="ttftSource"
        )
        prefix_match_info_producer_name: str | None = None
        latency_prediction_info_producer_name: str = ""
        in_flight_load_producer_name: str | None = None

    def __init__(self, params: Params | None = None, *, rng: random.Random | None = None) -> None:
        self._p = params or self.Params()
        self._rng = rng or random.Random()
        self._producer: PredictedLatencyProducer | None = None
        self.unjudged = 0  # gate decisions skipped: the predictor had nothing learned yet

    def bind(self, plugins: Mapping[str, object]) -> None:
        """Find the latency producer when the TTFT comes from it (after all are built)."""
        if self._p.ttft_source == "latencyPredictor":
            from extproc.scheduling.plugins.latency import find_producer

            self._producer = find_producer(
                plugins, self._p.latency_prediction_info_producer_name, self.type_name
            )

    def _ttft_ms(self, req: InferenceRequest, c: Candidate) -> float:
        uncached = req.prompt_tokens * (1.0 - prefix_fraction(req, c))
        tokens = c.state.inflight_tokens + uncached
        return tokens / self._p.peak_prefill_throughput * 1000.0

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        p = self._p
        if not req.block_keys:
            return cands
        sticky = [c for c in cands if prefix_fraction(req, c) >= p.affinity_threshold]
        if not sticky or len(sticky) == len(cands):
            return cands
        if p.exploration_probability and self._rng.random() < p.exploration_probability:
            return cands
        keep = {id(c) for c in sticky}
        others = [c for c in cands if id(c) not in keep]
        if self._producer is not None:
            ttft = {
                id(c): i.prediction.ttft_ms
                for c, i in zip(cands, self._producer.predictions(req, cands), strict=True)
                if i is not None
            }
            if not ttft:
                self.unjudged += 1
                return sticky
            # An endpoint without a prediction of its own cannot win the comparison.
            best_sticky = min(ttft.get(id(c), math.inf) for c in sticky)
            best_other = min(ttft.get(id(c), math.inf) for c in others)
        else:
            best_sticky = min(self._ttft_ms(req, c) for c in sticky)
            best_other = min(self._ttft_ms(req, c) for c in others)
        if best_sticky - best_other > p.max_ttft_penalty_ms:
            return others
        return sticky


class NoHitLRUScorer:
    """For requests that hit no endpoint's cache (a new prefix), prefers the endpoints that
        least recently received such a cold request, so new prefixes spread evenly and the fleet's
        cache capacity fills evenly. Requests that some endpoints hold more of than the others
    score 1.0 everywhere (no preference).

        ```yaml
        - type: no-hit-lru-scorer
          parameters: {lruSize: 1024, recordCold: endpoints}
        ```

    `recordCold`: which placements move the LRU. `endpoints`: a request new on every
    endpoint (the router reports a placement with the unfiltered endpoints). `scored`: also
    one this scorer scored as new on the candidates left to it, e.g. when
    `bounded-sessions-filter` removed the holders of a header every tenant shares; with
    `endpoints` such picks are spread by the LRU but never recorded, so the next one is
    spread by the same order (bench/RESULTS.md, issue 14, twenty-second session: 5-8 of the
    first second's 14-21 new-prefix decisions on tenants at 24 req/s).
    """

    type_name: ClassVar[str] = "no-hit-lru-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        lru_size: Annotated[int, msgspec.Meta(gt=0)] = 1024
        record_cold: Literal["endpoints", "scored"] = "endpoints"
        prefix_plugin_type: str | None = None
        prefix_plugin_name: str | None = None
        prefix_match_info_producer_name: str | None = None

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self._size = p.lru_size
        self._record_scored = p.record_cold == "scored"
        # `recordCold: scored`: the request last scored as new (scheduling is synchronous:
        # its placement is observed before another request is scored).
        self._scored_cold: InferenceRequest | None = None
        # address -> logical time of its last cold pick; oldest first.
        self._recent: OrderedDict[str, int] = OrderedDict()
        self._tick = 0
        # Told of each cold pick made here (replicas publish it: with an LRU of its own, each
        # replica spread only its third of the new prefixes, and their first picks collided).
        self.on_pick: Callable[[str], None] | None = None

    @staticmethod
    def _is_cold(cands: Sequence[Candidate]) -> bool:
        """A request is new when no endpoint holds more of it than most endpoints do: a
        prefix every server holds (a chat-template header, a shared first block) says
        nothing about where this request belongs; the part that distinguishes it decides.
        "Most" is a strict majority: with two endpoints, one holder of two is this
        request's own prefix (`>=` made it cold, and the LRU pull sent about half the warm
        requests of a two-server fleet to the server without their prefix)."""
        best = max((c.prefix_blocks for c in cands), default=0.0)
        if best <= 0:
            return True
        holders = sum(1 for c in cands if c.prefix_blocks >= best)
        return len(cands) > 1 and holders * 2 > len(cands)

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        if not self._is_cold(cands):
            return [1.0] * len(cands)
        if self._record_scored:
            self._scored_cold = req
        recent = self._recent
        never = [c.endpoint.address not in recent for c in cands]
        if all(never):
            return [1.0] * len(cands)
        ticks = [recent.get(c.endpoint.address, -1) for c in cands]
        scores = [1.0 if n else 0.0 for n in never]
        used = sorted({t for t in ticks if t >= 0})
        if len(used) > 1:
            rank = {t: i for i, t in enumerate(used)}
            top = len(used) - 1
            # Never-used endpoints 1.0; among used ones, the least recent scores highest.
            scores = [
                1.0 if n else 0.9 * (1.0 - rank[t] / top) for n, t in zip(never, ticks, strict=True)
            ]
        return scores

    def observe(
        self, req: InferenceRequest, cands: Sequence[Candidate], decision: Decision
    ) -> None:
        scored, self._scored_cold = self._scored_cold is req, None
        if not decision.endpoints or not (scored or self._is_cold(cands)):
            return
        addr = decision.primary.address
        self.picked(addr)
        if self.on_pick is not None:
            self.on_pick(addr)

    def picked(self, address: str) -> None:
        """`address` just received a cold request (here, or at a peer replica)."""
        self._tick += 1
        self._recent.pop(address, None)
        self._recent[address] = self._tick
        while len(self._recent) > self._size:
            self._recent.popitem(last=False)
