"""Synthetic engines for the latency model: cumulative vLLM histogram totals of a server
with known prefill cost, as successive scrapes would show them."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from extproc.endpoints.exposition import LatencyTotals
from extproc.latency import LatencyModel


@dataclass
class Engine:
    """A server whose prefill takes `per_request_s + per_token_s * tokens`, whose TTFT adds
    `overhead_s` and a queue wait, and whose inter-token latency is
    `itl_base_s + itl_per_seq_s * running`."""

    per_request_s: float = 0.004
    per_token_s: float = 0.0002  # 5,000 tokens/s
    overhead_s: float = 0.003
    itl_base_s: float = 0.010
    itl_per_seq_s: float = 0.001
    noise: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    totals: LatencyTotals = field(default_factory=lambda: LatencyTotals(prefill_tokens=0.0))

    def interval(self, requests: list[int], running: int = 4, queue_s: float = 0.0):
        """One scrape interval in which `requests` (uncached tokens each) were prefilled."""
        t = self.totals
        prefill = sum(self.prefill_s(n) for n in requests)
        queue = queue_s * len(requests)
        ttft = prefill + queue + self.overhead_s * len(requests)
        tokens = 20 * len(requests)
        itl = (self.itl_base_s + self.itl_per_seq_s * running) * tokens
        self.totals = LatencyTotals(
            ttft_sum=t.ttft_sum + ttft,
            ttft_count=t.ttft_count + len(requests),
            queue_sum=t.queue_sum + queue,
            queue_count=t.queue_count + len(requests),
            prefill_sum=t.prefill_sum + prefill,
            prefill_count=t.prefill_count + len(requests),
            itl_sum=t.itl_sum + itl,
            itl_count=t.itl_count + tokens,
            prefill_tokens=(t.prefill_tokens or 0.0) + sum(requests),
        )
        return self.totals

    def decode(self, tokens: int, running: int = 4) -> LatencyTotals:
        """One scrape interval in which only decode steps ran (`tokens` output tokens)."""
        t = self.totals
        itl = (self.itl_base_s + self.itl_per_seq_s * running) * tokens
        self.totals = dataclasses.replace(
            t, itl_sum=t.itl_sum + itl, itl_count=t.itl_count + tokens
        )
        return self.totals

    def prefill_s(self, tokens: int) -> float:
        s = self.per_request_s + self.per_token_s * tokens
        return s * (1.0 + self.rng.uniform(-self.noise, self.noise)) if self.noise else s


def teach(model: LatencyModel, address: str, engine: Engine, intervals: int = 30,
          running: int = 4, seed: int = 1) -> None:  # fmt: skip
    """Feed `intervals` scrapes of 1-4 requests of 100-3,000 uncached tokens each."""
    rng = random.Random(seed)
    model.learn(address, engine.totals, running)
    for _ in range(intervals):
        reqs = [rng.randint(100, 3000) for _ in range(rng.randint(1, 4))]
        model.learn(address, engine.interval(reqs, running), running)
