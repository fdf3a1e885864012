"""The prefill speed estimate: from the engine's prefill histograms where exported (queueing
excluded, so identical servers read alike whatever their queues), else from time to first
byte in the access log, which says so."""

from __future__ import annotations

import logging

from extproc.core import LatencyTotals
from extproc.endpoints.prefill_speed import PrefillSpeeds


class Engine:
    """Cumulative prefill histograms of one simulated engine: prefills run one at a time at
    `tps`, each with a fixed step overhead."""

    def __init__(self, tps: float, overhead_s: float = 0.0005) -> None:
        self.tps, self.overhead = tps, overhead_s
        self.tokens = self.seconds = self.count = 0.0

    def prefill(self, tokens: int) -> float:
        """Runs one prefill; returns its duration."""
        s = self.overhead + tokens / self.tps
        self.tokens += tokens
        self.seconds += s
        self.count += 1
        return s

    def totals(self) -> LatencyTotals:
        return LatencyTotals(
            prefill_sum=self.seconds, prefill_count=self.count, prefill_tokens=self.tokens
        )


def test_identical_servers_read_alike_whatever_their_queues():
    # Two servers at 20,000 tok/s; `a` is the one predicted TTFT favoured, so its requests
    # queued behind each other: time to first byte 1-8x the prefill. Issue 14: the access
    # log alone read identical servers 4x apart.
    sp = PrefillSpeeds()
    a, b = Engine(20000), Engine(20000)
    for name, e in (("a", a), ("b", b)):
        sp.scraped(name, e.totals())  # the baseline scrape
    for i in range(40):
        tokens = 1000 + 97 * (i % 7)
        for name, e, queued in (("a", a, 1 + i % 8), ("b", b, 1)):
            s = e.prefill(tokens)
            sp.observe(name, tokens, s * queued)  # the access log's sample: queueing in
            if i % 3 == 2:
                sp.scraped(name, e.totals())
    ra, rb = sp.get("a"), sp.get("b")
    assert ra is not None and rb is not None
    assert abs(ra / rb - 1) < 0.02, (ra, rb)
    assert 0.9 * 20000 < ra < 20000  # the step overhead only
    assert sp.sources() == {"engine": 2, "access_log": 0}


def test_a_slower_server_reads_slower_and_a_changed_one_follows_within_the_window():
    sp = PrefillSpeeds()
    fast, slow = Engine(20000), Engine(5000)
    for name, e in (("fast", fast), ("slow", slow)):
        sp.scraped(name, e.totals())
        for _ in range(5):
            e.prefill(2000)
            sp.scraped(name, e.totals())
    assert sp.get("fast") / sp.get("slow") > 3.5  # type: ignore[operator]
    slow.tps = 20000  # another tenant left the GPU
    for _ in range(40):
        slow.prefill(2000)
        sp.scraped("slow", slow.totals())
    assert abs(sp.get("slow") / sp.get("fast") - 1) < 0.02  # type: ignore[operator]


def test_overhead_only_intervals_and_restarts_teach_nothing_wrong():
    sp = PrefillSpeeds()
    e = Engine(20000, overhead_s=0.01)
    sp.scraped("a", e.totals())
    e.prefill(16)  # a fully cached prompt's last block: all overhead
    sp.scraped("a", e.totals())
    assert sp.get("a") is None and sp.samples == 0
    e.prefill(4000)
    sp.scraped("a", e.totals())
    learned = sp.get("a")
    assert learned is not None and learned > 10000
    # A new engine process: counters restart from 0. The old window goes, the drop is no
    # sample, and the next interval is measured from the new baseline.
    fresh = Engine(5000)
    sp.scraped("a", fresh.totals())
    assert sp.snapshot() == {}
    fresh.prefill(4000)
    sp.scraped("a", fresh.totals())
    assert abs(sp.get("a") / 5000 - 1) < 0.01  # type: ignore[operator]


def test_without_histograms_the_access_log_speaks_and_says_so(caplog):
    sp = PrefillSpeeds()
    with caplog.at_level(logging.WARNING):
        sp.scraped("old", None)
        sp.scraped("old", LatencyTotals(prefill_sum=1.0, prefill_count=2.0))  # no token sum
    assert sum("exports no prefill" in r.getMessage() for r in caplog.records) == 1
    sp.observe("old", 5000, 1.0)
    assert sp.get("old") == 5000
    e = Engine(20000)
    sp.scraped("new", e.totals())
    e.prefill(3000)
    sp.scraped("new", e.totals())
    assert sp.sources() == {"engine": 1, "access_log": 1}
    # Estimates changed unit: the access log's samples follow, the engine's count its own
    # tokens and stay.
    before = sp.get("new")
    sp.units_changed(2.0)
    assert sp.get("old") == 10000 and sp.get("new") == before
    sp.forget("new")
    assert sp.get("new") == 10000  # the fleet's median, of what is left


def test_tokens_and_seconds_counted_in_different_scrapes_still_meet():
    # vLLM may count a request's computed tokens (by source) at its first token and observe
    # its prefill time when it finishes: an interval with tokens and no seconds, then one
    # with seconds and no tokens. Neither alone is a speed; together they are the right one.
    sp = PrefillSpeeds()
    tokens = seconds = count = 0.0
    sp.scraped("a", LatencyTotals(prefill_sum=0.0, prefill_count=0.0, prefill_tokens=0.0))
    for _ in range(10):
        tokens += 2000
        sp.scraped(
            "a", LatencyTotals(prefill_sum=seconds, prefill_count=count, prefill_tokens=tokens)
        )
        seconds += 0.1
        count += 1
        sp.scraped(
            "a", LatencyTotals(prefill_sum=seconds, prefill_count=count, prefill_tokens=tokens)
        )
    assert abs(sp.get("a") / 20000 - 1) < 0.01  # type: ignore[operator]


def test_the_fastest_speed_is_the_engines_where_one_exports_it():
    # Flow control's reserve sizes a prefill's time by `fastest`: an access-log sample is
    # queueing plus prefill, so the engine's own figure, where there is one, wins over it.
    sp = PrefillSpeeds()
    sp.add("a", 50_000.0)  # a sample the access log overestimated (the index under-credited)
    assert sp.fastest() == 50_000.0
    engine = Engine(8000)
    sp.scraped("b", engine.totals())
    for _ in range(4):
        engine.prefill(4000)
    sp.scraped("b", engine.totals())
    assert sp.fastest() is not None and 7000 < sp.fastest() < 8000
