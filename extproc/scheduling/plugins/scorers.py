"""Load scorers: prefer endpoints with less work queued, running or placed on them.

Scores computed from scraped metrics treat stale or never-scraped figures as the worst case
(0.0): an endpoint whose metrics stopped arriving is probably in trouble, and it should not
win on numbers we no longer believe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, InferenceRequest
from extproc.scheduling.plugins.ttft import uncached_tokens


def lower_is_better(values: Sequence[float]) -> list[float]:
    """Min-max normalisation: the smallest value scores 1.0, the largest 0.0; all 1.0 when
    they are equal (nothing to prefer)."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]


class _NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class QueueScorer:
    """Prefers short queues (`vllm:num_requests_waiting`), min-max normalised over the
    candidates; stale endpoints score 0.

    ```yaml
    - type: queue-scorer
    ```
    """

    type_name: ClassVar[str] = "queue-scorer"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        scores = lower_is_better([c.state.waiting for c in cands])
        return [0.0 if c.state.is_stale else s for s, c in zip(scores, cands, strict=True)]


class KVCacheUtilizationScorer:
    """Prefers free KV cache: `1 - kv_usage` (usage is a 0..1 fraction); stale endpoints
    score 0.

    `countRequest: true` (opt-in) scores the KV left once this request is placed: its
    uncached prompt tokens (what the endpoint does not hold of its prefix) count as used
    too, over the engine's KV capacity (`kv_blocks` x `kv_block_size`; endpoints of
    unknown capacity keep `1 - kv_usage`). A prefix holder's used blocks are largely the
    prefix this request shares, and a cold server must write the whole prompt: counting
    only what is used now penalised the holder for the very blocks the request reuses and
    moved tenants off it on a small cache. Opt-in: interleaved runs split both ways
    (bench/RESULTS.md, issue 14, eleventh session). Output tokens are left out: they take
    the same blocks on every candidate.

    ```yaml
    - type: kv-cache-utilization-scorer
      parameters: {countRequest: false}
    ```
    """

    type_name: ClassVar[str] = "kv-cache-utilization-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        count_request: bool = False

    def __init__(self, params: Params | None = None) -> None:
        self._count_request = (params or self.Params()).count_request

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        out = []
        count = self._count_request
        for c in cands:
            st = c.state
            free = 1.0 - st.kv_usage
            if count and st.kv_blocks and st.kv_block_size:
                free -= uncached_tokens(req, c) / (st.kv_blocks * st.kv_block_size)
            # Clamped inline: this runs per candidate per request.
            out.append(0.0 if st.is_stale or free < 0.0 else (1.0 if free > 1.0 else free))
        return out


class ActiveRequestScorer:
    """Prefers endpoints with fewer in-flight requests placed by the pickers, min-max
    normalised. In-flight counts move at the decision, so a burst spreads before any
    model-server metric can.

    ```yaml
    - type: active-request-scorer
    ```
    """

    type_name: ClassVar[str] = "active-request-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        """llm-d's parameters, accepted; check-config says they have no effect here."""

        request_timeout: str | None = None
        idle_threshold: int | None = None
        max_busy_score: float | None = None
        in_flight_load_producer_name: str | None = None

    def __init__(self, params: Params | None = None) -> None:
        pass

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        return lower_is_better([c.state.inflight_requests for c in cands])


class TokenLoadScorer:
    """Prefers endpoints with fewer estimated in-flight prompt tokens (a long prompt weighs
    more than a short one), min-max normalised.

    ```yaml
    - type: token-load-scorer
    ```
    """

    type_name: ClassVar[str] = "token-load-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        """llm-d's parameters, accepted; check-config says they have no effect here."""

        queue_threshold_tokens: int | None = None
        in_flight_load_producer_name: str | None = None

    def __init__(self, params: Params | None = None) -> None:
        pass

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        return lower_is_better([c.state.inflight_tokens for c in cands])

    def explain(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[dict[str, float]]:
        """Per candidate, the load it was scored on and what the engine last reported: the
        in-flight requests and prompt tokens placed there (what flow control's concurrency
        detector counts too), the scraped KV use, waiting and running requests and their
        age (-1: never scraped). A trace compares these books with the engine's own KV."""
        out = []
        for c in cands:
            st = c.state
            out.append(
                {
                    "inflight_tokens": st.inflight_tokens,
                    "inflight_requests": st.inflight_requests,
                    "kv_usage": st.kv_usage,
                    "waiting": st.waiting,
                    "running": st.running,
                    "age_s": -1.0 if st.age_s is None else st.age_s,
                }
            )
        return out


class LoadAwareScorer:
    """An absolute load score: 1.0 for an idle endpoint, falling linearly to 0.0 when
    waiting requests plus the in-flight requests beyond those already running reach
    `threshold`. Unlike min-max scorers it does not exaggerate tiny differences between
    lightly loaded endpoints. Stale endpoints score 0.

    ```yaml
    - type: load-aware-scorer
      parameters: {threshold: 128}
    ```
    """

    type_name: ClassVar[str] = "load-aware-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        threshold: Annotated[int, msgspec.Meta(gt=0)] = 128

    def __init__(self, params: Params | None = None) -> None:
        self._threshold = (params or self.Params()).threshold

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        t = self._threshold
        out = []
        for c in cands:
            s = c.state
            if s.is_stale:
                out.append(0.0)
                continue
            # In-flight requests the server has not yet reported as running are queued work.
            load = s.waiting + max(0, s.inflight_requests - s.running)
            out.append(1.0 - min(load, t) / t)
        return out


class LoraAffinityScorer:
    """For requests naming a LoRA adapter: 1.0 where it is already running, 0.8 where it is
    waiting to load, 0.6 where there is a free adapter slot, 0.0 otherwise. Requests without
    an adapter score 1.0 everywhere (no preference).

    ```yaml
    - type: lora-affinity-scorer
    ```
    """

    type_name: ClassVar[str] = "lora-affinity-scorer"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        adapter = req.lora_adapter
        if not adapter:
            return [1.0] * len(cands)
        out = []
        for c in cands:
            s = c.state
            if adapter in s.running_adapters:
                out.append(1.0)
            elif adapter in s.waiting_adapters:
                out.append(0.8)
            elif s.max_adapters is None or len(s.running_adapters) < s.max_adapters:
                out.append(0.6)
            else:
                out.append(0.0)
        return out
