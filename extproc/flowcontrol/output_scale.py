"""The unit outputs are counted in (`flow_control.output_token_scale`).

Why: flow control adds each request's prompt, as the picker estimates it, to its output, in
real tokens (the expectation or the request's max_tokens). Where the estimate runs over the
engine's count (approximate mode's bytes per token is a whole number: the overload bench's
simulator covers ~1.3 characters a token, the estimate 1, so it reads 1.28 estimated tokens
per real one) the two do not add up: a server of short prompts, whose output is a larger part
of its KV, holds more than counted, and interactive requests placed there waited for the
engine's KV (bench/RESULTS.md, fifteenth session, lead (b)). Outputs times the estimate's
tokens per real token count in one unit.

The scale is configured (a number), or `auto`: measured. Approximate mode's calibration
(extproc/calibration.py) pairs each engine's counted prompt tokens with the picker's
estimates of the same requests, per endpoint and window; the scale is the inverse of the
median of the endpoints' last ratios, re-read at every scrape, so it follows calibration
(and its change of unit: calibration carries the ratios over). Precise mode counts the
tokenizer's tokens: its estimate is the engine's count, the scale exactly 1. Until a window
closes (or with calibration off) nothing is measured: outputs count 1:1, said in a log line
and in the metric's `source` (`unmeasured`), never silently.

Only the requests admitted from then on are counted in the new unit; each ticket keeps the
counts it was admitted with, so what it took is what it gives back.

A configured scale is a ratio of the estimate at the configured bytes per token: when
calibration changes it, the scale follows by the same factor as every estimate
(`units_changed`), and so does a measured one at once rather than at the next scrape.
`unmeasured` stays 1.0: it states nothing about the estimate's unit.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping
from typing import Literal

log = logging.getLogger("extproc.flowcontrol")

# The configured setting's bounds (config.py): a measured scale is clamped into them too.
SCALE_BOUNDS = (0.25, 4.0)
# A measured scale moves the counted outputs only when it moved by more than this fraction
# (windows jitter by a percent or two; a new unit every scrape helps nobody).
_STEP = 0.01

Source = Literal["configured", "measured", "unmeasured", "exact"]


class OutputScale:
    """Estimated tokens per real token for outputs, and where that figure comes from
    (`source`): `configured`, `measured` (calibration), `unmeasured` (auto, nothing
    measured yet: 1.0), `exact` (precise keys: estimates are the engine's counts)."""

    __slots__ = ("auto", "source", "value")

    def __init__(self, setting: float | Literal["auto"]) -> None:
        self.auto = setting == "auto"
        self.value = 1.0 if setting == "auto" else float(setting)
        self.source: Source = "unmeasured" if self.auto else "configured"

    def exact(self) -> None:
        """Estimates are the engine's token counts (precise mode): nothing to measure."""
        if self.auto:
            self.value, self.source = 1.0, "exact"

    def unmeasurable(self, why: str) -> None:
        """Said once at start when `auto` has no measurement to wait for."""
        if self.auto and self.source == "unmeasured":
            log.warning("flow_control.output_token_scale auto: %s; outputs count 1:1", why)

    def units_changed(self, factor: float) -> None:
        """Token estimates are now `factor` times what they were for the same prompt."""
        if factor <= 0 or self.source not in ("configured", "measured"):
            return
        lo, hi = SCALE_BOUNDS
        self.value = min(hi, max(lo, self.value * factor))

    def measured(self, ratios: Mapping[str, float]) -> None:
        """Calibration's last engine-tokens-per-estimate ratio per endpoint (its stats)."""
        if not self.auto or self.source == "exact":
            return
        seen = [r for r in ratios.values() if r > 0]
        if not seen:
            return
        lo, hi = SCALE_BOUNDS
        scale = min(hi, max(lo, 1.0 / statistics.median(seen)))
        if self.source == "measured" and abs(scale - self.value) <= _STEP * self.value:
            return
        if self.source != "measured":
            log.info(
                "flow_control.output_token_scale auto: measured %.3f estimated tokens per "
                "engine token (%d endpoints); outputs count in that unit from now on",
                scale,
                len(seen),
            )
        self.value, self.source = scale, "measured"
