"""How long a request decodes on each server: the engine's own mean, first token to last.

vLLM observes `request_decode_time_seconds` for each request when it finishes; between two
scrapes the sum's growth over the count's is the mean decode of the requests that finished in
between. Kept per server as a moving average of those interval means, so a batch that grows
(each sequence decodes slower) or a workload whose answers get longer moves it within a few
scrapes. Read by `predicted-ttft-scorer`'s KV-fit term: a request that does not fit beside the
running ones waits until one of them ends, and a running request ends a decode after its first
token.

Servers with no measurement yet get the fleet's median; with none anywhere, None (the reader
says so: a wait it cannot time is not a wait of zero).
"""

from __future__ import annotations

import math
import statistics

from extproc.core import LatencyTotals

# Weight of each interval's mean: about the last 5 intervals that finished anything matter.
_ALPHA = 0.2


class DecodeTimes:
    """Mean decode seconds per finished request, per server address. Event-loop only."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}  # address: (decode sum, count)
        self._mean: dict[str, float] = {}

    def scraped(self, address: str, totals: LatencyTotals | None) -> None:
        """A scrape of `address`: its latency histograms' totals (None: none exported)."""
        if totals is None or not totals.decode_count:
            return
        now = (totals.decode_sum, totals.decode_count)
        last = self._last.get(address)
        self._last[address] = now
        if last is None:
            return
        d_sum, d_n = now[0] - last[0], now[1] - last[1]
        if d_n < 0 or d_sum < 0:
            return  # counters went back: a new engine process; the next interval measures
        if d_n == 0 or not math.isfinite(d_sum):
            return
        sample = d_sum / d_n
        old = self._mean.get(address)
        self._mean[address] = sample if old is None else old + _ALPHA * (sample - old)

    def get(self, address: str) -> float | None:
        """The server's mean decode seconds, else the fleet median, else None."""
        own = self._mean.get(address)
        if own is not None:
            return own
        return statistics.median(self._mean.values()) if self._mean else None
