"""Prefill speed per server, learned online from what the picker sees: the uncached prompt
tokens it placed on a server and the time to that request's first response byte (from the
gateway's access log).

A request's time to first byte is queueing plus prefill, so one sample can say "slower"
(it queued) or "faster" (the server held more of the prompt than the index credited); the
estimate is the median of the last samples, which neither kind moves far. Samples with too
few tokens say more about overheads than about prefill and are skipped. Servers with no
sample yet get the fleet's median, so a homogeneous fleet needs no calibration at all.

Replicas sharing Redis share their samples (server/shared_observations.py): each replica
places about a third of the requests, and a window of its own samples alone gave the same
server 8,800 tok/s on one replica and 72,000 on another in one run, so the replicas' predicted
TTFT ranked servers differently and moved sessions on that noise.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Mapping
from types import MappingProxyType

# Below this many uncached tokens, time to first byte is mostly fixed overhead.
MIN_SAMPLE_TOKENS = 256
# Samples kept per server: a changed server shows within about half as many requests.
WINDOW = 31


class PrefillSpeeds:
    """Tokens per second per server address. Event-loop only."""

    def __init__(self) -> None:
        self._samples: dict[str, deque[float]] = {}
        self._tps: dict[str, float] = {}
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

    def get(self, address: str) -> float | None:
        """The learned speed, else the fleet median, else None (nothing learned yet)."""
        tps = self._tps.get(address)
        return tps if tps is not None else self.fleet()

    def fastest(self) -> float | None:
        """The fastest sample kept, over every server (None before any): the closest to a
        prefill alone, since a sample's time-to-first-byte includes any queueing before it
        (under load the median is mostly queueing)."""
        return max((max(w) for w in self._samples.values() if w), default=None)

    def fleet(self) -> float | None:
        """The median of the learned speeds (None before any sample)."""
        return statistics.median(self._tps.values()) if self._tps else None

    def forget(self, address: str) -> None:
        self._tps.pop(address, None)
        self._samples.pop(address, None)

    def snapshot(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self._tps))
