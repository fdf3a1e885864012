"""Prefill speed per server: uncached prompt tokens per second of prefill.

Two sources, the engine's own first:

- **The engine's histograms**, at every scrape: the uncached tokens it prefilled
  (`request_prefill_kv_computed_tokens` sum) over the seconds it was busy prefilling them,
  over the last `WINDOW` intervals that prefilled anything (vLLM without the
  computed-tokens histogram: its `prompt_tokens_by_source{source="local_compute"}`). The
  seconds come from `request_prefill_time_seconds`, which times each request from its first
  scheduled step to its first token: prefills sharing engine steps (vLLM's chunked prefill
  batches every waiting prompt into the step's token budget) each count every shared step,
  so their plain sum reads a busy server 2x and more slower than an idle identical one (19,593
  vs 10,416 tok/s in tests/e2e/test_prefill_speed.py). The `busy` estimator (default) counts
  each busy second once (`busy_time`): the engine's throughput, which is what predicted TTFT
  divides by, since it models the queue ahead itself (queued tokens / speed: a speed slowed
  by that same queue counted it twice, and moved requests off busy cache holders, issue 14).
  `request` (opt-in) is the plain per-request ratio, the price one request experiences.
  Queueing is in neither (vLLM times prefill from the request's first scheduling), nor the
  picker's guess of what the server held: identical servers read alike. Every replica
  scrapes every server, so replicas agree without sharing anything.
- **The access log**, for engines exporting neither sum (sglang, older vLLM): a request's
  uncached tokens as the picker estimated them over its time to first byte. That is
  queueing plus prefill, and the estimate may credit what the server had evicted, so one
  sample says "slower" (it queued) or "faster" (it held more than credited); the estimate
  is the median of the last samples. On a loaded 2-core machine identical simulated servers
  read 980 and 3,888 tok/s this way in one run, and new prompts went to the
  fastest-measured one (issue 14); an endpoint learned this way is counted in
  `extproc_prefill_speed_endpoints{source="access_log"}` and logged once.

Samples with too few tokens say more about overheads than about prefill and are skipped.
Servers with no sample yet get the fleet's median, so a homogeneous fleet needs no
calibration at all.

Replicas sharing Redis share their access-log samples (server/shared_observations.py):
each replica places about a third of the requests, and a window of its own samples alone
gave the same server 8,800 tok/s on one replica and 72,000 on another in one run.

Units: access-log samples are in the picker's token estimates (rescaled when approximate
mode's calibration changes them); engine samples are in the engine's tokens, which the
calibrated estimates approximate. Predicted TTFT compares servers by ratios, which a
common factor does not change.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from extproc.core import LatencyTotals
from extproc.endpoints.busy_time import covered, segment

log = logging.getLogger(__name__)

# Below this many uncached tokens, time to first byte is mostly fixed overhead.
MIN_SAMPLE_TOKENS = 256
# Samples kept per server: a changed server shows within about half as many requests
# (access log), or scrape intervals with prefill work (engine).
WINDOW = 31


Estimator = Literal["busy", "request"]


@dataclass(frozen=True, slots=True)
class _Interval:
    """What one scrape interval added: tokens, prefill seconds (per request, summed), and
    the busy segment those seconds covered (None: no prefill ended in it)."""

    tokens: float
    seconds: float
    busy: tuple[float, float] | None


@dataclass(slots=True)
class _Engine:
    """One server's prefill histograms: the previous scrape's totals and recent intervals."""

    totals: LatencyTotals
    at: float  # clock() at the previous scrape
    window: deque[_Interval] = field(default_factory=lambda: deque(maxlen=WINDOW))
    tps: float | None = None
    # Prefill seconds summed per request over busy seconds, in the window: how many
    # prefills shared the engine on average (1: one at a time).
    overlap: float | None = None


class PrefillSpeeds:
    """Tokens per second per server address. Event-loop only.

    `estimator`: how the engine's histograms become a speed (`busy`: tokens per second the
    engine was busy prefilling; `request`: per second of each request's prefill, overlaps
    counted again). `clock`: monotonic seconds, read at each scrape."""

    def __init__(
        self, estimator: Estimator = "busy", *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.estimator: Estimator = estimator
        self._clock = clock
        self._samples: dict[str, deque[float]] = {}
        self._tps: dict[str, float] = {}  # access-log medians
        self._engine: dict[str, _Engine] = {}
        self._no_histograms: set[str] = set()  # scraped, exporting no prefill sums
        self.samples = 0
        # Told of each sample taken here (address, tokens/s): replicas publish it.
        self.on_sample: Callable[[str, float], None] | None = None

    def observe(self, address: str, tokens: int, ttfb_s: float | None) -> None:
        if ttfb_s is None or ttfb_s <= 0 or tokens < MIN_SAMPLE_TOKENS:
            return
        tps = tokens / ttfb_s
        self.add(address, tps)
        if self.on_sample is not None:
            self.on_sample(address, tps)

    def add(self, address: str, tps: float) -> None:
        """One sample in tokens/s (a peer replica's, or this replica's own)."""
        if not tps > 0 or tps == float("inf"):
            return
        window = self._samples.get(address)
        if window is None:
            window = self._samples[address] = deque(maxlen=WINDOW)
        window.append(tps)
        self.samples += 1
        self._tps[address] = statistics.median(window)

    def scraped(self, address: str, totals: LatencyTotals | None, *, age_s: float = 0.0) -> None:
        """A scrape of `address` (its latency histograms' totals; None: none exported),
        taken `age_s` seconds ago (a peer replica's: the intervals between scrapes are
        timed from when each was taken)."""
        if totals is None or totals.prefill_tokens is None:
            if address not in self._no_histograms:
                self._no_histograms.add(address)
                log.warning(
                    "endpoint %s exports no prefill-time and computed-token histograms: its "
                    "prefill speed is learned from time to first byte, queueing included",
                    address,
                )
            return
        self._no_histograms.discard(address)
        now = self._clock() - max(0.0, age_s)
        e = self._engine.get(address)
        if e is None:
            self._engine[address] = _Engine(totals, now)
            return
        if now < e.at:
            return  # older than the last one kept (shared scrapes arriving out of order)
        last, interval_s = e.totals, now - e.at
        e.totals, e.at = totals, now
        assert last.prefill_tokens is not None  # only totals with tokens are kept
        d_tok = totals.prefill_tokens - last.prefill_tokens
        d_s = totals.prefill_sum - last.prefill_sum
        d_n = totals.prefill_count - last.prefill_count
        d_dec = totals.decode_sum - last.decode_sum
        d_dec_n = totals.decode_count - last.decode_count
        if d_tok < 0 or d_s < 0 or d_n < 0 or d_dec < 0 or d_dec_n < 0:
            # Counters went back: a new engine process, maybe on other hardware.
            e.window.clear()
            e.tps = e.overlap = None
            return
        if d_tok == 0 and d_s == 0:
            return  # nothing prefilled since the last scrape
        # Every interval with work counts, whatever its own ratio: vLLM observes a request's
        # prefill time when the request finishes, and may count its tokens (by source) at
        # its first token, so one interval can hold the tokens and a later one their
        # seconds; summed over the window they meet again.
        busy = segment(now, interval_s, d_s, d_n, d_dec, d_dec_n)
        e.window.append(_Interval(d_tok, d_s, busy))
        tokens_in = math.fsum(i.tokens for i in e.window)
        seconds_in = math.fsum(i.seconds for i in e.window)
        if tokens_in < MIN_SAMPLE_TOKENS or seconds_in <= 0:
            return  # fully cached prompts only so far: fixed overhead, not speed
        busy_in = covered(i.busy for i in e.window if i.busy is not None)
        if busy_in <= 0:
            return
        first = e.tps is None
        e.overlap = seconds_in / busy_in
        e.tps = tokens_in / (busy_in if self.estimator == "busy" else seconds_in)
        self.samples += 1
        if first:
            log.info(
                "endpoint %s: prefill speed from the engine's histograms, %s estimator "
                "(%.0f tokens/s, %.2f prefills sharing each busy second)",
                address,
                self.estimator,
                e.tps,
                e.overlap,
            )

    def units_changed(self, factor: float) -> None:
        """Token estimates are now `factor` times what they were (approximate mode changed
        its bytes per token): every sample is rescaled, else for a whole window of samples
        per server a prompt in the new unit would be priced at a speed in the old one (4x
        off after a 4 -> 1 change)."""
        if factor <= 0:
            return
        for window in self._samples.values():
            scaled = [v * factor for v in window]
            window.clear()
            window.extend(scaled)
        self._tps = {a: v * factor for a, v in self._tps.items()}

    def _own(self, address: str) -> float | None:
        e = self._engine.get(address)
        if e is not None and e.tps is not None:
            return e.tps
        return self._tps.get(address)

    def get(self, address: str) -> float | None:
        """The learned speed (the engine's, else the access log's), else the fleet median,
        else None (nothing learned yet)."""
        tps = self._own(address)
        return tps if tps is not None else self.fleet()

    def fastest(self) -> float | None:
        """The fastest server's speed (None before any): the engines' own where any exports
        them (queueing is not in them), else the fastest access-log sample kept, the closest
        to a prefill alone, since a sample's time to first byte includes any queueing
        before it (under load the median is mostly queueing)."""
        engine = [e.tps for e in self._engine.values() if e.tps is not None]
        if engine:
            return max(engine)
        return max((max(w) for w in self._samples.values() if w), default=None)

    def fleet(self) -> float | None:
        """The median of the learned speeds (None before any sample)."""
        speeds = self.snapshot()
        return statistics.median(speeds.values()) if speeds else None

    def forget(self, address: str) -> None:
        self._tps.pop(address, None)
        self._samples.pop(address, None)
        self._engine.pop(address, None)
        self._no_histograms.discard(address)

    def snapshot(self) -> Mapping[str, float]:
        """Each measured server's speed, the engine's where it has one."""
        out = dict(self._tps)
        for address, e in self._engine.items():
            if e.tps is not None:
                out[address] = e.tps
        return MappingProxyType(out)

    def overlaps(self) -> Mapping[str, float]:
        """Per server measured from its histograms: prefill seconds counted per request
        over busy seconds (the `busy` estimate is the `request` one times this)."""
        return MappingProxyType(
            {a: e.overlap for a, e in self._engine.items() if e.overlap is not None}
        )

    def sources(self) -> Mapping[str, int]:
        """Measured servers by where their speed comes from: engine, access_log."""
        engine = sum(1 for e in self._engine.values() if e.tps is not None)
        return {"engine": engine, "access_log": len(self.snapshot()) - engine}
