"""Mean decode time per server from the engine's decode histogram between scrapes."""

from __future__ import annotations

import pytest

from extproc.core import LatencyTotals
from extproc.endpoints.decode_time import DecodeTimes


def totals(s: float, n: float) -> LatencyTotals:
    return LatencyTotals(decode_sum=s, decode_count=n)


def test_interval_means_averaged_per_server_with_the_fleet_median_for_the_rest():
    d = DecodeTimes()
    d.scraped("a", totals(10.0, 20))  # the first scrape is a base, not a sample
    assert d.get("a") is None and d.get("b") is None
    d.scraped("a", totals(11.5, 25))  # 5 requests, 1.5 s: 0.3 s each
    assert d.get("a") == pytest.approx(0.3)
    d.scraped("a", totals(11.5, 25))  # nothing finished: no sample
    d.scraped("a", totals(12.8, 27))  # 0.65 s each: moves a fifth of the way
    assert d.get("a") == pytest.approx(0.3 + 0.2 * 0.35)
    assert d.get("b") == d.get("a")  # not measured: the fleet's median
    d.scraped("a", totals(0.2, 1))  # counters went back (a restart): skipped, new base
    d.scraped("a", totals(0.5, 2))
    assert d.get("a") == pytest.approx(0.37 + 0.2 * (0.3 - 0.37))
    d.scraped("b", None)  # no histograms exported
    d.scraped("b", LatencyTotals())
    assert d.get("b") == d.get("a")
