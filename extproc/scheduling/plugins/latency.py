"""SLO-aware scheduling on predicted latency, with llm-d's plugin names, parameters and
request headers:

- `predicted-latency-producer`: owns the endpoint latency model (extproc/latency), predicts
  TTFT/TPOT per candidate once per request, and computes SLO headroom; listed first in a
  profile (it passes every candidate through).
- `latency-scorer`: scores by headroom (lowest predicted latency when no SLO is asked for).
- `slo-headroom-tier-filter`: keeps the endpoints predicted to meet the SLOs, when any.
- `latency-slo-admitter`: sheds (429) sheddable requests no endpoint can serve within SLO.

SLOs come in `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms` (or the older `x-slo-ttft-ms` /
`x-slo-tpot-ms`), in milliseconds; values that are not positive numbers are ignored.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import msgspec

from extproc.core import Candidate, Decision, InferenceRequest
from extproc.errors import ConfigError, Overloaded
from extproc.latency import LatencyModel, ModelSettings, Prediction
from extproc.protocol import (
    OBJECTIVE_HEADERS,
    PREDICTED_TTFT_HEADER,
    TPOT_SLO_HEADERS,
    TTFT_SLO_HEADERS,
)
from extproc.scheduling.plugins.prefix import prefix_fraction
from extproc.scheduling.plugins.scorers import lower_is_better

_NonNeg = Annotated[float, msgspec.Meta(ge=0.0)]
_Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


def slo_ms(headers: Mapping[str, str], names: tuple[str, ...]) -> float:
    """The first header of `names` holding a positive finite number of milliseconds, else 0."""
    for name in names:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            return 0.0
        return value if math.isfinite(value) and value > 0 else 0.0
    return 0.0


def uncached_tokens(req: InferenceRequest, c: Candidate) -> float:
    """Prompt tokens this endpoint would have to prefill (the rest it holds): the prompt
    minus the whole blocks matched (a fraction of the prompt would charge the last, partial
    block as if it were whole). A match that stops short of the end stops inside a shared
    stretch as often as not at its end: the engine, with its smaller blocks, holds on
    average half of the first unmatched block too."""
    bt = req.block_tokens
    if not bt:
        return req.prompt_tokens * (1.0 - prefix_fraction(req, c))
    matched = c.prefix_blocks
    if 0 < matched < len(req.block_keys):
        matched += 0.5
    return max(0.0, req.prompt_tokens - matched * bt)


@dataclass(frozen=True, slots=True)
class LatencyInfo:
    """One candidate's prediction and SLO headroom (SLO - predicted, ms; with no SLO the
    target is 0, so headroom is minus the prediction). `tpot_neutral`: TPOT does not count
    for this endpoint (non-streaming mode, a prefill endpoint, or no TPOT data)."""

    prediction: Prediction
    ttft_headroom_ms: float
    tpot_headroom_ms: float
    tpot_neutral: bool

    @property
    def meets_slo(self) -> bool:
        return self.ttft_headroom_ms >= 0.0 and self.tpot_headroom_ms >= 0.0


class PredictedLatencyProducer:
    """Predicts each candidate's TTFT and TPOT from a latency model learned online from the
    endpoints' own vLLM latency histograms (prefill, queue, TTFT, inter-token latency) and
    the work this picker placed; no throughput is configured anywhere. Computes SLO headroom
    for the latency plugins. Put it first in the profile; it removes no candidate.

    llm-d's parameters are accepted so configs carry over; `sloBufferFactor` scales the TPOT SLO,
    `streamingMode: false` (llm-d's default) makes TPOT neutral, `endpointRoleLabel` makes
    TPOT neutral on prefill endpoints; the XGBoost-sidecar ones have no effect (check-config
    notes them).
    `model` tunes learning (forgetting, minSamples, smoothing), `learnIntervalMs` how often
    scrapes are read, `responseHeader: true` returns the pick's predicted TTFT to the client
    in `x-extproc-predicted-ttft-ms`.

    ```yaml
    - type: predicted-latency-producer
      parameters: {streamingMode: true}
    ```
    """

    type_name: ClassVar[str] = "predicted-latency-producer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        sampling_mean: float = 1000.0
        max_decode_token_samples_for_prediction: int = 0
        slo_buffer_factor: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
        # llm-d spells it with TTL in capitals, which camel renaming would not produce.
        context_ttl: str = msgspec.field(default="5m", name="contextTTL")
        streaming_mode: bool = False
        endpoint_role_label: str = ""
        predict_in_produce: bool = True
        use_encoder_cache_features: bool = False
        encoder_cache_match_info_producer_name: str = ""
        # llm-d (newer) names the prefix and in-flight producers to read; here the match
        # comes from the shared index and the counts are the picker's own, so they are
        # accepted and name nothing (as on the prefix and load scorers; check-config notes
        # them, scheduling/llmd/table.py).
        prefix_match_info_producer_name: str | None = None
        in_flight_load_producer_name: str | None = None
        model: ModelSettings = ModelSettings()
        learn_interval_ms: Annotated[float, msgspec.Meta(gt=0.0)] = 50.0
        response_header: bool = False

    def __init__(self, params: Params | None = None, *, model: LatencyModel | None = None) -> None:
        self.params = p = params or self.Params()
        self.model = model or LatencyModel(p.model)
        # The last request's predictions by address. Scheduling never awaits, so every
        # plugin asking during one `schedule` call sees the same request's figures.
        self._req: InferenceRequest | None = None
        self._infos: dict[str, LatencyInfo | None] = {}
        self._slo = (0.0, 0.0)
        self._now = 0.0

    @property
    def learn_interval_s(self) -> float:
        return self.params.learn_interval_ms / 1000.0

    def _begin(self, req: InferenceRequest) -> None:
        self._req = req
        self._infos = {}
        f = self.params.slo_buffer_factor
        h = req.headers
        # As llm-d: the buffer factor scales the TPOT objective only.
        self._slo = (slo_ms(h, TTFT_SLO_HEADERS), slo_ms(h, TPOT_SLO_HEADERS) * f)
        self._now = self.model.now()

    def slos_ms(self, req: InferenceRequest) -> tuple[float, float]:
        """(TTFT, TPOT) SLOs of `req` in ms (TPOT after `sloBufferFactor`); 0: none."""
        if req is not self._req:
            self._begin(req)
        return self._slo

    def predictions(
        self, req: InferenceRequest, cands: Sequence[Candidate]
    ) -> list[LatencyInfo | None]:
        """One `LatencyInfo` per candidate (None: no prediction yet), computed once per
        request and endpoint."""
        if req is not self._req:
            self._begin(req)
        infos = self._infos
        out: list[LatencyInfo | None] = []
        for c in cands:
            addr = c.endpoint.address
            if addr not in infos:
                infos[addr] = self._info(req, c)
            out.append(infos[addr])
        return out

    def _info(self, req: InferenceRequest, c: Candidate) -> LatencyInfo | None:
        if not self.params.predict_in_produce:
            return None
        pred = self.model.predict(c.endpoint.address, c.state, uncached_tokens(req, c), self._now)
        if pred is None:
            return None
        ttft_slo, tpot_slo = self._slo
        p = self.params
        neutral = (
            not p.streaming_mode
            or pred.tpot_ms is None
            or (bool(p.endpoint_role_label) and c.endpoint.labels.get(p.endpoint_role_label)
                == "prefill")
        )  # fmt: skip
        tpot_h = 0.0 if neutral else tpot_slo - (pred.tpot_ms or 0.0)
        return LatencyInfo(pred, ttft_slo - pred.ttft_ms, tpot_h, neutral)

    # Filter: runs first in the profile so predictions exist; removes nothing.
    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        self.predictions(req, cands)
        return cands

    # Observer: the chosen endpoint now has this request's prefill ahead of later ones.
    def observe(
        self, req: InferenceRequest, cands: Sequence[Candidate], decision: Decision
    ) -> None:
        if not decision.endpoints:
            return
        # With disaggregation the prefill endpoint computes the prompt, not the decode one.
        target = decision.prefill or decision.primary
        now = self.model.now()
        for c in cands:
            if c.endpoint.address == target.address:
                self.model.place(
                    target.address, uncached_tokens(req, c), now, float(req.prompt_tokens)
                )
                return

    # ResponseObserver: the time outside the engine, from streamed responses' headers.
    def responded(self, req: InferenceRequest, decision: Decision, elapsed_s: float) -> None:
        if req.stream and decision.endpoints:
            self.model.responded(decision.primary.address, elapsed_s)

    # ResponseHeaders: the pick's predicted TTFT, when asked for.
    def response_headers(self, decision: Decision) -> Mapping[str, str]:
        if not self.params.response_header or not decision.endpoints:
            return {}
        info = self._infos.get(decision.primary.address)
        if info is None:
            return {}
        return {PREDICTED_TTFT_HEADER: f"{info.prediction.ttft_ms:.1f}"}


def find_producer(plugins: Mapping[str, object], name: str, who: str) -> PredictedLatencyProducer:
    """The producer a latency plugin reads from: the one named `name`, or the only one."""
    if name:
        found = plugins.get(name)
        if not isinstance(found, PredictedLatencyProducer):
            raise ConfigError(f"{who}: no predicted-latency-producer named {name!r}")
        return found
    producers = [p for p in plugins.values() if isinstance(p, PredictedLatencyProducer)]
    if len(producers) != 1:
        raise ConfigError(
            f"{who} needs exactly one predicted-latency-producer in plugins "
            f"(found {len(producers)}); name one with latencyPredictionInfoProducerName"
        )
    return producers[0]


class _Consumer:
    """A plugin that reads the producer's predictions (bound after every plugin is built)."""

    _producer: PredictedLatencyProducer | None = None
    _producer_name: str = ""

    def bind(self, plugins: Mapping[str, object]) -> None:
        self._producer = find_producer(plugins, self._producer_name, self.type_name)  # type: ignore[attr-defined]

    def _infos(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[LatencyInfo | None]:
        if self._producer is None:
            raise RuntimeError(f"{self.type_name} used before bind()")  # type: ignore[attr-defined]
        return self._producer.predictions(req, cands)


def _idle(c: Candidate) -> bool:
    st = c.state
    return st.inflight_requests == 0 and (st.is_stale or (st.running == 0 and st.waiting == 0))


class LatencyScorer(_Consumer):
    """Scores endpoints by predicted latency headroom (SLO - predicted). With no SLO header
    the headroom is minus the prediction, so the lowest predicted latency scores highest.
    When some endpoints meet the SLOs, only they score; when none does, idle endpoints come
    first, then the least severe violation (TPOT only, TTFT only, both). TTFT and TPOT
    headroom are min-max normalised and blended by `ttftWeight` / `tpotWeight`;
    `headroomSelectionStrategy: least` prefers the endpoint closest to the SLO (packing),
    `most` the one with most headroom. Without predictions (nothing learned yet) it scores
    on load: KV usage, queue and prefix weighted by the `composite*Weight` parameters.

    ```yaml
    - type: latency-scorer
      parameters: {ttftWeight: 0.8, tpotWeight: 0.2}
    ```
    """

    type_name: ClassVar[str] = "latency-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        ttft_weight: _NonNeg = 0.8
        tpot_weight: _NonNeg = 0.2
        headroom_selection_strategy: Literal["least", "most"] = "least"
        # llm-d's spelling (KV in capitals), which camel renaming would not produce.
        composite_kv_weight: _NonNeg = msgspec.field(default=1.0, name="compositeKVWeight")
        composite_queue_weight: _NonNeg = 1.0
        composite_prefix_weight: _NonNeg = 1.0
        latency_prediction_info_producer_name: str = ""
        queue_cost: bool = True

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()
        self._producer_name = self.params.latency_prediction_info_producer_name
        self.fallbacks = 0  # requests scored on load because nothing was predicted

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        infos = self._infos(req, cands)
        if all(i is None for i in infos):
            self.fallbacks += 1
            return self._composite(req, cands)
        n = len(cands)
        scores = [0.0] * n
        has_slo = any(self._producer.slos_ms(req)) if self._producer else False
        pos = [i for i, info in enumerate(infos) if info is not None and info.meets_slo]
        if pos:
            chosen, positive = pos, True
        else:
            chosen = [i for i, info in enumerate(infos) if info is not None]
            positive = False
            if has_slo:
                idle = [i for i in chosen if _idle(cands[i])]
                chosen = idle or _least_severe(chosen, infos)
        p = self.params
        most = positive and p.headroom_selection_strategy == "most"
        if positive or not p.queue_cost:
            heads = [infos[i].ttft_headroom_ms for i in chosen]  # type: ignore[union-attr]
        else:
            # Nothing meets the objective (or none was given): the lowest latency wins, and
            # that counts the wait this request's prefill adds to those queued behind it.
            heads = [_queue_cost_headroom_ms(infos[i]) for i in chosen]  # type: ignore[arg-type]
        ttft = _normalise(heads, most)
        tpot = _normalise([infos[i].tpot_headroom_ms for i in chosen], most)  # type: ignore[union-attr]
        wt, wp = p.ttft_weight, p.tpot_weight
        if ttft is None and tpot is None:
            for i in chosen:
                scores[i] = 1.0
            return scores
        if ttft is None:
            wt, ttft = 0.0, [0.0] * len(chosen)
        if tpot is None:
            wp, tpot = 0.0, [0.0] * len(chosen)
        total = wt + wp
        if total <= 0.0:
            wt, total = 1.0, 1.0
        for k, i in enumerate(chosen):
            scores[i] = (wt * ttft[k] + wp * tpot[k]) / total
        return scores

    def _composite(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        p = self.params
        total = p.composite_kv_weight + p.composite_queue_weight + p.composite_prefix_weight
        if total <= 0.0:
            return [1.0] * len(cands)
        queue = lower_is_better([c.state.waiting for c in cands])
        out = []
        for c, q in zip(cands, queue, strict=True):
            kv = 0.0 if c.state.is_stale else max(0.0, 1.0 - c.state.kv_usage)
            q = 0.0 if c.state.is_stale else q
            s = (
                p.composite_kv_weight * kv
                + p.composite_queue_weight * q
                + p.composite_prefix_weight * prefix_fraction(req, c)
            )
            out.append(s / total)
        return out


def _queue_cost_headroom_ms(info: LatencyInfo) -> float:
    """TTFT headroom less the wait this request's prefill adds to the requests that will
    queue behind it (`Prediction.cost_s`)."""
    pred = info.prediction
    return info.ttft_headroom_ms - (pred.cost_s - pred.ttft_s) * 1000.0


def _least_severe(chosen: list[int], infos: Sequence[LatencyInfo | None]) -> list[int]:
    """Among violators: only TPOT violated, then only TTFT, then both (llm-d's buckets)."""
    buckets: tuple[list[int], list[int], list[int]] = ([], [], [])
    for i in chosen:
        info = infos[i]
        assert info is not None
        ttft_bad, tpot_bad = info.ttft_headroom_ms < 0, info.tpot_headroom_ms < 0
        buckets[0 if not ttft_bad else (1 if not tpot_bad else 2)].append(i)
    return next((b for b in buckets if b), chosen)


def _normalise(values: list[float], most: bool) -> list[float] | None:
    """Headroom to [0, 1]: higher headroom better with `most`, else closest to zero from
    either side... for negatives that is the highest value too, for positives the lowest.
    None when every value is equal (the dimension cannot tell endpoints apart)."""
    lo, hi = min(values), max(values)
    span = hi - lo
    if span <= 0.0:
        return None
    if most or hi <= 0.0:
        return [(v - lo) / span for v in values]
    if lo >= 0.0:
        return [(hi - v) / span for v in values]
    # Mixed signs only happen within one tier in theory; nearest to zero wins.
    dist = [abs(v) for v in values]
    return lower_is_better(dist)


class SloHeadroomTierFilter(_Consumer):
    """Keeps the endpoints predicted to meet the request's SLOs (TTFT and TPOT headroom both
    >= 0) when there are any, except with probability `epsilonExploreNeg`, when it keeps the
    others, so an endpoint recovering from overload is measured again. Endpoints without a
    prediction count as missing the SLO; with no prediction at all everything passes.

    ```yaml
    - type: slo-headroom-tier-filter
      parameters: {epsilonExploreNeg: 0.01}
    ```
    """

    type_name: ClassVar[str] = "slo-headroom-tier-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        epsilon_explore_neg: _Fraction = 0.01
        latency_prediction_info_producer_name: str = ""

    def __init__(self, params: Params | None = None, *, rng: random.Random | None = None) -> None:
        self.params = params or self.Params()
        self._producer_name = self.params.latency_prediction_info_producer_name
        self._rng = rng or random.Random()

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        infos = self._infos(req, cands)
        if all(i is None for i in infos):
            return cands
        pos = [c for c, i in zip(cands, infos, strict=True) if i is not None and i.meets_slo]
        if not pos or len(pos) == len(cands):
            return cands
        if self._rng.random() < self.params.epsilon_explore_neg:
            keep = {id(c) for c in pos}
            return [c for c in cands if id(c) not in keep]
        return pos


class LatencySloAdmitter(_Consumer):
    """Sheds a sheddable request (priority < 0) that carries an SLO header when no endpoint
    is predicted to meet it, none is idle and none is cold (KV usage under 2%, where
    predictions are least reliable): the client gets 429 at once instead of a late answer.
    Requests with priority >= 0, or without SLO headers, or without predictions, are always
    admitted. Priority comes from the request's `x-llm-d-inference-objective` header looked
    up in `objectivePriorities` (what an InferenceObjective declares), else
    `defaultPriority`. Declared in `plugins` only (it is not part of a profile); it runs
    before the profiles.

    ```yaml
    - type: latency-slo-admitter
      parameters: {objectivePriorities: {batch: -1, chat: 10}}
    ```
    """

    type_name: ClassVar[str] = "latency-slo-admitter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        objective_priorities: dict[str, int] = msgspec.field(default_factory=dict)
        default_priority: int = 0
        latency_prediction_info_producer_name: str = ""

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()
        self._producer_name = self.params.latency_prediction_info_producer_name
        self.shed = 0

    def priority(self, req: InferenceRequest) -> int:
        for name in OBJECTIVE_HEADERS:
            objective = req.headers.get(name)
            if objective is not None:
                return self.params.objective_priorities.get(objective, self.params.default_priority)
        return self.params.default_priority

    def admit(self, req: InferenceRequest, cands: Sequence[Candidate]) -> None:
        """Returns when admitted; raises `Overloaded` (429) to shed."""
        if self.priority(req) >= 0 or not cands:
            return
        assert self._producer is not None
        if not any(self._producer.slos_ms(req)):
            return
        infos = self._infos(req, cands)
        if all(i is None for i in infos):
            return  # nothing to judge by: admit (the scorer falls back to load)
        for c, info in zip(cands, infos, strict=True):
            st = c.state
            if info is not None and info.meets_slo:
                return
            if not st.is_stale and (st.running == 0 or st.kv_usage < 0.02):
                return
        self.shed += 1
        raise Overloaded("no endpoint can serve this request within its latency objective")
