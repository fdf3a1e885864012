"""Prefill speed per server, learned online from what the picker sees: the uncached prompt
tokens it placed on a server and the time to that request's first response byte (from the
gateway's access log).

A request's time to first byte is queueing plus prefill, so tokens / ttfb is a lower bound
on the server's speed; the estimate is a slowly decaying maximum of those samples, which
tracks the unqueued requests. Samples with too few tokens say more about overheads than
about prefill and are skipped. Servers with no sample yet get the fleet's median, so a
homogeneous fleet needs no calibration at all (the speed cancels out of comparisons).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from types import MappingProxyType

# Below this many uncached tokens, time to first byte is mostly fixed overhead.
MIN_SAMPLE_TOKENS = 256
# Per sample, the estimate moves this fraction of the way down towards a slower sample
# (faster samples are taken at once): servers slowing down are noticed within ~30 requests.
DECAY = 0.05


class PrefillSpeeds:
    """Tokens per second per server address. Event-loop only."""

    def __init__(self) -> None:
        self._tps: dict[str, float] = {}
        self.samples = 0

    def observe(self, address: str, tokens: int, ttfb_s: float | None) -> None:
        if ttfb_s is None or ttfb_s <= 0 or tokens < MIN_SAMPLE_TOKENS:
            return
        sample = tokens / ttfb_s
        self.samples += 1
        old = self._tps.get(address)
        if old is None or sample >= old:
            self._tps[address] = sample
        else:
            self._tps[address] = old + DECAY * (sample - old)

    def get(self, address: str) -> float | None:
        """The learned speed, else the fleet median, else None (nothing learned yet)."""
        tps = self._tps.get(address)
        if tps is not None:
            return tps
        if not self._tps:
            return None
        return statistics.median(self._tps.values())

    def forget(self, address: str) -> None:
        self._tps.pop(address, None)

    def snapshot(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self._tps))
