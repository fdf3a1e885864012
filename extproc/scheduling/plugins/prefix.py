"""Prefix-cache affinity: score and gate endpoints by how much of a request's prefix they
already hold (from the global KV-block index), and spread requests that hit nowhere."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal

import msgspec

from extproc.core import Candidate, Decision, InferenceRequest

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
    is configured in the `index` settings; llm-d's parameters are accepted so configs carry
    over, and `mode` is informational.

    ```yaml
    - type: prefix-cache-scorer
    ```
    """

    type_name: ClassVar[str] = "prefix-cache-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        mode: Literal["approximate", "precise", "auto"] = "auto"
        block_size: int | None = None
        max_prefix_blocks_to_match: int | None = None
        lru_capacity_per_server: int | None = None

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        n = len(req.block_keys)
        if not n:
            return [0.0] * len(cands)
        return [c.prefix_blocks / n if c.prefix_blocks < n else 1.0 for c in cands]


class PrefixCacheAffinityFilter:
    """Keeps only the endpoints that hold at least `threshold` of the request's prefix, when
    any does, so a cached conversation sticks where its cache is.

    Stickiness breaks when it would hurt: when the best sticky endpoint's predicted TTFT
    (the prefill work already placed on it, plus this request's uncached tokens, over
    `peakPrefillTokensPerSecond`) exceeds the best other endpoint's by more than
    `maxTTFTPenaltyMs`, the request goes to the others instead, so a burst on one hot prefix
    spills over to more endpoints rather than queueing on one. With `explorationProbability`
    the filter lets everything through at random, so the index keeps learning.

    ```yaml
    - type: prefix-cache-affinity-filter
      parameters: {threshold: 0.8, maxTTFTPenaltyMs: 18000, peakPrefillTokensPerSecond: 10000}
    ```
    """

    type_name: ClassVar[str] = "prefix-cache-affinity-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        threshold: _Fraction = 0.8
        # llm-d spells it with TTFT in capitals, which camel renaming would not produce.
        max_ttft_penalty_ms: Annotated[float, msgspec.Meta(ge=0.0)] = msgspec.field(
            default=18000.0, name="maxTTFTPenaltyMs"
        )
        peak_prefill_tokens_per_second: Annotated[float, msgspec.Meta(gt=0.0)] = 10000.0
        exploration_probability: _Fraction = 0.0

    def __init__(self, params: Params | None = None, *, rng: random.Random | None = None) -> None:
        self._p = params or self.Params()
        self._rng = rng or random.Random()

    def _ttft_ms(self, req: InferenceRequest, c: Candidate) -> float:
        uncached = req.prompt_tokens * (1.0 - prefix_fraction(req, c))
        tokens = c.state.inflight_tokens + uncached
        return tokens / self._p.peak_prefill_tokens_per_second * 1000.0

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        p = self._p
        if not req.block_keys:
            return cands
        sticky = [c for c in cands if prefix_fraction(req, c) >= p.threshold]
        if not sticky or len(sticky) == len(cands):
            return cands
        if p.exploration_probability and self._rng.random() < p.exploration_probability:
            return cands
        keep = {id(c) for c in sticky}
        others = [c for c in cands if id(c) not in keep]
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
          parameters: {lruSize: 1024}
        ```
    """

    type_name: ClassVar[str] = "no-hit-lru-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        lru_size: Annotated[int, msgspec.Meta(gt=0)] = 1024

    def __init__(self, params: Params | None = None) -> None:
        self._size = (params or self.Params()).lru_size
        # address -> logical time of its last cold pick; oldest first.
        self._recent: OrderedDict[str, int] = OrderedDict()
        self._tick = 0

    @staticmethod
    def _is_cold(cands: Sequence[Candidate]) -> bool:
        """A request is new when no endpoint holds more of it than most endpoints do: a
        prefix every server holds (a chat-template header, a shared first block) says
        nothing about where this request belongs; the part that distinguishes it decides."""
        best = max((c.prefix_blocks for c in cands), default=0.0)
        if best <= 0:
            return True
        holders = sum(1 for c in cands if c.prefix_blocks >= best)
        return len(cands) > 1 and holders * 2 >= len(cands)

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        if not self._is_cold(cands):
            return [1.0] * len(cands)
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
        if not decision.endpoints or not self._is_cold(cands):
            return
        self._tick += 1
        addr = decision.primary.address
        self._recent.pop(addr, None)
        self._recent[addr] = self._tick
        while len(self._recent) > self._size:
            self._recent.popitem(last=False)
