"""How much of each server's KV cache the approximate index may credit it with.

The approximate index only knows what the picker sent where; a server's cache holds a bounded
number of tokens (`vllm:cache_config_info`: num_gpu_blocks x block_size) and evicts the least
recently used. So the index keeps, per endpoint, only as many of our blocks as fit: the least
recently written go first (see `MemoryKVIndex.set_capacity`), and a server is never credited
with prefixes it must have evicted.

Our blocks are sized by an estimate (`block_tokens` estimated tokens from bytes), which can
be far off for a given tokenizer. The ratio of real to estimated tokens is measured: the
engine's cumulative prompt-token counter (`prefix_cache_queries`, every prompt token it was
asked for) against the estimated prompt tokens the picker placed there since the same scrape.

Calibration may change the unit of those estimates mid-run (`bytes_per_token`, say 4 -> 1 for a
tokenizer of ~1.3 characters per token: every estimate 4x larger). A cumulative measurement
then mixes both units for the rest of the run: in the demo the ratio stayed ~1.6x too high, so
every server was credited with ~60% of what its cache really held and the index forgot the
prefixes of groups that were still resident (they were spread like new prefixes). So
`units_changed` carries the ratio over in the new unit and restarts the measurement.

Replicas behind one gateway each place a share of a server's requests, while the engine
counts them all: the ratio of totals would be the replica count times too high (3 replicas:
each server credited with a third of its cache, and with a shared index the replicas trim
it to that). So where the engine also counts its requests (`request_prompt_tokens`), the
ratio is taken per request: real prompt tokens per request the engine finished (both from
that histogram, so requests still running count in neither) over estimated tokens per
request this picker placed, whatever share of the traffic it sees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.core import Candidate, InferenceRequest

log = logging.getLogger("extproc.index.capacity")

# Estimated tokens placed before the measured ratio is trusted over 1.0.
_MIN_TOKENS = 20_000
# With `first_min_tokens`: requests the engines finished, and requests placed, in the first
# per-request measurement (a mean over fewer is one prompt's size).
_FIRST_MIN_REQUESTS = 4
# Estimated tokens of the early first measurement once peers' placements are pooled here
# (`peer_placed`), when `first_min_tokens` is not set.
_POOLED_FIRST_TOKENS = 4_000
# Recompute capacities every this many decisions (cheap, but not per request).
_EVERY = 32


@dataclass(slots=True)
class CapacityStats:
    """`ratio`: real tokens per estimated token, as last measured. `measured`: measurements
    by source: `per_request` (the engines' request_prompt_tokens histograms, right whatever
    share of the traffic this replica places) or `totals` (token counters only: with N
    picker replicas each server is credited with about 1/N of its cache)."""

    ratio: float = 1.0
    measured: dict[str, int] = field(default_factory=dict)


class CapacityModel:
    """Feeds per-endpoint capacities (in our blocks) to an index that takes them."""

    def __init__(
        self,
        set_capacity: Callable[[str, int], None],
        scraped: Callable[[str], Any] | None = None,
        *,
        first_min_tokens: int | None = None,
    ) -> None:
        """`first_min_tokens` (None: off): until the first measurement, measure at every
        decision and trust the per-request ratio from this many estimated tokens placed (and
        4 requests finished and placed) instead of 20,000 every 32 decisions: three replicas
        each reached 20,000 of their own only after 3-4 s, and meanwhile the 1.0 prior
        credited each server with ~3x its cache while the estimates were uncalibrated
        (bench/RESULTS.md, issue 14, twelfth session). Once a peer replica's placement has
        been pooled here (`peer_placed`) the first measurement is early anyway, from
        `first_min_tokens` or 4,000: with three replicas the 1.0 prior held for 3-4 s, a
        lone replica's first measurement stays where it was (early on one replica lost
        in the thirteenth session)."""
        self._set = set_capacity
        self._scraped = scraped
        self._first_min = first_min_tokens
        self._pooled = False  # a peer's placement was counted here
        self._sent: dict[str, int] = {}
        self._placed: dict[str, int] = {}  # estimated prompt tokens placed, per endpoint
        self._requests: dict[str, int] = {}  # requests placed, per endpoint
        # first (queries, placed, engine requests or -1, their prompt tokens, requests placed)
        self._base: dict[str, tuple[int, int, int, float, int]] = {}
        # Placements since capacities were last recomputed (this replica's decisions and
        # pooled peers' placements); None: recompute at the next decision.
        self._since: int | None = None
        self.stats = CapacityStats()

    @property
    def ratio(self) -> float:
        """Real tokens per estimated token (kept in the stats, which /metrics reads)."""
        return self.stats.ratio

    @ratio.setter
    def ratio(self, value: float) -> None:
        self.stats.ratio = value

    def placed(self, address: str, request: InferenceRequest) -> None:
        self.placed_tokens(address, request.prompt_tokens)

    def placed_tokens(self, address: str, tokens: int) -> None:
        self._placed[address] = self._placed.get(address, 0) + tokens
        self._requests[address] = self._requests.get(address, 0) + 1

    def peer_placed(self, address: str, tokens: int) -> None:
        """A peer replica pooling its placements placed `tokens` estimated tokens (in this
        replica's unit) on `address`: measured with this replica's, and counted towards the
        next recompute (every 32 of one replica's own decisions took 4 s at a third of 24
        req/s: the first measurement came after calibration even when pooled)."""
        self.placed_tokens(address, tokens)
        if not self._pooled:
            self._pooled = True
            log.info(
                "capacity: peers' placements pooled; the first ratio is measured from %d "
                "estimated tokens",
                self._early_tokens,
            )
        if self._since is not None:
            self._since += 1

    @property
    def _early_tokens(self) -> int | None:
        """Estimated tokens the first measurement needs when early (None: not early)."""
        if self._first_min is not None:
            return self._first_min
        return _POOLED_FIRST_TOKENS if self._pooled else None

    def units_changed(self, factor: float) -> None:
        """Every token estimate from now on is `factor` times what it was for the same prompt
        (calibration changed bytes per token by 1 / factor). The measured ratio is carried over
        in the new unit; the measurement restarts at each endpoint's next scrape, so estimates
        of the old unit never mix with the new; capacities are recomputed at the next
        decision."""
        if factor <= 0:
            return
        self._base.clear()
        self._since = None
        if not self.stats.measured:
            # Nothing measured yet: 1.0 is the prior ("estimates are right"), which
            # calibration just made truer. Divided by the factor it credited every server
            # with 4x its cache (4 -> 1 bytes per token) until measured anew: three replicas
            # pooling calibration changed at 2 s, before any had placed the 20,000 estimated
            # tokens a measurement needs, and "index credited chosen, engine had evicted"
            # misses doubled (bench/RESULTS.md, issue 14, tenth session).
            log.info("capacity ratio not measured yet: the prior %.3f holds", self.ratio)
            return
        self.ratio /= factor
        log.info("capacity ratio carried over to new token estimates: %.3f", self.ratio)

    def update(self, request: InferenceRequest, cands: Sequence[Candidate]) -> None:
        early = self._early_tokens is not None and not self.stats.measured
        if self._since is not None and not early:
            self._since += 1
            if self._since < _EVERY:
                return
        if not request.block_tokens:
            return
        self._since = 0
        self._measure(cands)
        per_block = request.block_tokens * self.ratio
        for c in cands:
            st = c.state
            if not st.kv_blocks or not st.kv_block_size:
                continue
            cap = max(1, int(st.kv_blocks * st.kv_block_size / per_block))
            addr = c.endpoint.address
            if self._sent.get(addr) != cap:
                self._sent[addr] = cap
                self._set(addr, cap)

    def _measure(self, cands: Sequence[Candidate]) -> None:
        if self._scraped is None:
            return
        real = est = 0
        # The same, per request, over the endpoints whose engine counts its requests.
        real_pr = est_pr = 0
        served = ours = 0
        for c in cands:
            addr = c.endpoint.address
            s = self._scraped(addr)
            queries = getattr(s, "prefix_cache_queries", None)
            if queries is None:
                continue
            latency = getattr(s, "latency", None)
            engine_n = int(latency.prompt_count) if latency is not None else -1
            engine_tokens = latency.prompt_sum if latency is not None else 0.0
            placed = self._placed.get(addr, 0)
            n = self._requests.get(addr, 0)
            base = self._base.get(addr)
            if base is None or queries < base[0] or engine_n < base[2]:
                # First sight, or the engine restarted.
                self._base[addr] = (queries, placed, engine_n, engine_tokens, n)
                continue
            real += queries - base[0]
            est += placed - base[1]
            if base[2] >= 0 and engine_n > base[2] and n > base[4]:
                real_pr += int(engine_tokens - base[3])
                est_pr += placed - base[1]
                served += engine_n - base[2]
                ours += n - base[4]
        first_min = self._early_tokens if not self.stats.measured else None
        if (
            first_min is not None
            and est_pr >= first_min
            and real_pr > 0
            and min(served, ours) >= _FIRST_MIN_REQUESTS
        ):
            self.ratio = (real_pr / served) / (est_pr / ours)
            self._count("per_request")
            log.info("capacity ratio first measured early: %.3f", self.ratio)
        elif est_pr >= _MIN_TOKENS and real_pr > 0:
            self.ratio = (real_pr / served) / (est_pr / ours)
            self._count("per_request")
        elif est >= _MIN_TOKENS and real > 0:
            self.ratio = real / est
            self._count("totals")
            if self.stats.measured["totals"] == 1:  # said once
                log.warning(
                    "KV capacity measured from token totals: the engines do not export "
                    "request_prompt_tokens, so with several picker replicas each server is "
                    "credited with only this replica's share of its cache"
                )

    def _count(self, source: str) -> None:
        self.stats.measured[source] = self.stats.measured.get(source, 0) + 1
