"""A request counted as the engine will hold it (`flow_control.count_engine_blocks`, opt-in).

Why: the concurrency detector counts each in-flight request as its prompt estimate plus its
output, against the server's KV size times one `kvCacheFraction` (estimated tokens per engine
KV token, measured over a mix). Per request the ratio is not one number: the prompt estimate
runs ~1.28 estimated tokens per engine token while outputs are counted in real tokens, and
the engine holds whole blocks (prompt + max_tokens rounded up to its block size), which is
a larger part of a short request. Traced on the overload bench (bench/trace_kvwait.py,
twenty-first session), every interactive request that waited for the engine's KV with no
wait in the picker was placed on a server whose requests the books counted at 1.205-1.233
estimated tokens per engine KV token against the fraction's 1.246: 7-22 blocks (1-3% of the
server) more held than counted, on a server the lower band had filled to its 0.99 ceiling.
Not another replica's placements, not requests queued ahead in the engine, not a stale
scrape: the rebuilt sets matched the engine's held blocks exactly.

So each request is counted as `kvCacheFraction` x the engine's KV for it: its prompt in
engine tokens (the estimate times calibration's measured engine tokens per estimated token)
plus its output in real tokens, rounded up to whole blocks of the server's block size. A
server's count is then the fraction times its engine's blocks, whatever its mix, up to the
estimate's own per-request error. The flow request keeps its tokens for fairness and the
reserve; only the room checks (what a server holds, what a request will take) use this.

Until calibration has measured a ratio, requests are counted at a prior ratio, the inverse
of the fraction: the fraction is estimated tokens per engine KV token over whole requests,
whose outputs count one to one and whose blocks round up, so where the estimate runs over
the engine's count (as it does from bytes) a prompt's own ratio is above it and the prior
counts a prompt's engine tokens a little high, the safe side (the overload bench: 0.804
against the measured 0.779). Before, those requests counted their tokens, ~6 s into each
burst in the bench, and kept that count to their end; two of the five waits left in the
twenty-first session's runs came then. Counting at the prior is a degraded state: said
once in a log line and counted in `extproc_flow_engine_blocks_prior_total`. While no block
size is known requests are counted by their tokens: said once and counted in
`extproc_flow_engine_blocks_unmeasured_total` (never silently).

The fraction and the prior are ratios of the estimate: when approximate mode's calibration
changes its bytes per token, every estimate becomes `factor` times what it was, the fraction
(estimated tokens per engine KV token) with it and the prior (its inverse) by the inverse,
and so does the measured ratio until calibration's next window (`units_changed`).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping

log = logging.getLogger("extproc.flowcontrol")


class EngineBlocks:
    """Converts a request's counted tokens to the detector's unit for what the engine holds.
    Fed at every scrape (`measured`); event loop only."""

    __slots__ = (
        "_warned",
        "_warned_prior",
        "block_size",
        "enabled",
        "fraction",
        "per_estimate",
        "prior",
        "prior_counted",
        "unmeasured",
    )

    def __init__(self, enabled: bool, fraction: float) -> None:
        """`fraction`: the detector's estimated tokens per engine KV token (its
        `kvCacheFraction`; 0 when its ceiling is not the KV size: nothing to convert to),
        in the estimates' present unit (`units_changed` keeps it so)."""
        self.enabled = enabled and fraction > 0
        self.fraction = fraction
        self.per_estimate: float | None = None  # engine prompt tokens per estimated token
        self.block_size: int | None = None
        # Until calibration measures: the fraction's inverse (see the module's docstring).
        self.prior = 1.0 / fraction if fraction > 0 else 0.0
        self.unmeasured = 0  # requests counted by their tokens for want of a block size
        self.prior_counted = 0  # requests counted at the prior ratio for want of a ratio
        self._warned = False
        self._warned_prior = False
        if enabled and not fraction:
            log.warning(
                "flow_control.count_engine_blocks has no effect: the saturation detector's "
                "ceiling is not the servers' KV size (concurrency-detector in tokens mode with "
                "kvCacheFraction)"
            )

    def measured(self, ratios: Mapping[str, float], block_size: int | None) -> None:
        """Calibration's engine-tokens-per-estimate ratio per endpoint and a scraped block
        size; the median ratio is taken (one unit for the pool, as output_token_scale)."""
        seen = [r for r in ratios.values() if r > 0]
        if seen:
            self.per_estimate = statistics.median(seen)
        if block_size:
            self.block_size = block_size

    def units_changed(self, factor: float) -> None:
        """Token estimates are now `factor` times what they were for the same prompt: the
        fraction follows (the detector's `kv_fraction` does too), the prior and a measured
        ratio (engine tokens per estimated token) go by the inverse. Calibration carries its
        own ratios over alike, so the next scrape's `measured` agrees."""
        if factor <= 0 or not self.fraction:
            return
        self.fraction *= factor
        self.prior = 1.0 / self.fraction
        if self.per_estimate is not None:
            self.per_estimate /= factor

    def exact(self, block_size: int | None = None) -> None:
        """Precise mode: estimates are the engine's token counts."""
        self.per_estimate = 1.0
        if block_size:
            self.block_size = block_size

    def tokens(self, prompt: int, output: int, output_scale: float = 1.0) -> int:
        """What a request of `prompt` estimated (uncached) prompt tokens and `output` counted
        output tokens (real tokens times `output_scale`) takes, in the detector's unit; 0
        when off or no block size is known yet (the caller counts its tokens)."""
        if not self.enabled:
            return 0
        per, bs = self.per_estimate, self.block_size
        if not bs:
            self.unmeasured += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "flow_control.count_engine_blocks: no KV block size scraped yet; "
                    "requests count their tokens until then"
                )
            return 0
        if per is None:
            per = self.prior
            self.prior_counted += 1
            if not self._warned_prior:
                self._warned_prior = True
                log.warning(
                    "flow_control.count_engine_blocks: no calibration ratio measured yet; "
                    "prompts count %.3f engine tokens per estimated token (1 / "
                    "kvCacheFraction) until then",
                    per,
                )
        real = prompt * per + output / output_scale
        # vLLM allocates blocks for prompt + max_tokens - 1 (the last token's KV is never
        # written), at least one.
        blocks = max(1, math.ceil((real - 1) / bs))
        return max(1, round(self.fraction * blocks * bs))
