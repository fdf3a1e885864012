"""Saturation detectors: llm-d's formulas on EndpointState figures."""

from __future__ import annotations

import pytest

from extproc.core import EndpointState
from extproc.flowcontrol.detectors import ConcurrencyDetector, UtilizationDetector

fresh = {"age_s": 0.05, "is_stale": False}


def test_utilization_roofline_average():
    d = UtilizationDetector()
    states = [
        EndpointState(waiting=5, kv_usage=0.1, **fresh),  # queue-bound: 1.0
        EndpointState(waiting=0, kv_usage=0.4, **fresh),  # KV-bound: 0.5
    ]
    assert d.saturation(states, 0, 0) == pytest.approx(0.75)
    # Released work not yet visible in a scrape counts against the queue threshold.
    assert d.saturation(states, 5, 0) == pytest.approx(1.25)


def test_utilization_stale_or_unscraped_counts_full():
    d = UtilizationDetector(UtilizationDetector.Params(metricsStalenessThreshold="100ms"))
    assert d.saturation([EndpointState(age_s=0.5)], 0, 0) == 1.0
    assert d.saturation([EndpointState()], 0, 0) == 1.0
    assert d.saturation([], 0, 0) == 1.0


def test_concurrency_modes():
    s = [EndpointState(inflight_requests=4, inflight_tokens=100), EndpointState()]
    req = ConcurrencyDetector(ConcurrencyDetector.Params(maxConcurrency=4))
    assert req.saturation(s, 0, 0) == pytest.approx(0.5)
    assert req.saturation(s, 4, 0) == pytest.approx(1.0)
    tok = ConcurrencyDetector(
        ConcurrencyDetector.Params(concurrencyMode="tokens", maxTokenConcurrency=100)
    )
    assert tok.saturation(s, 0, 100) == pytest.approx(1.0)
    hyb = ConcurrencyDetector(
        ConcurrencyDetector.Params(
            concurrencyMode="hybrid", maxConcurrency=8, maxTokenConcurrency=100
        )
    )
    # endpoint 1: max(4/8, 100/100) = 1; endpoint 2: 0 -> 0.5
    assert hyb.saturation(s, 0, 0) == pytest.approx(0.5)


def test_released_work_fills_known_kv_before_it_counts_as_waiting():
    """With the engine's KV size known, pending tokens are projected into KV use; only what
    does not fit counts as waiting (without it, one release would count a whole waiting
    request and hold back higher bands until the next scrape)."""
    det = UtilizationDetector(
        UtilizationDetector.Params(queueDepthThreshold=1, kvCacheUtilThreshold=0.95)
    )
    fresh = EndpointState(kv_usage=0.5, age_s=0.0, is_stale=False, kv_block_size=16, kv_blocks=100)
    # 1 request of 160 tokens on 1,600 tokens of KV: +0.1 KV, no waiting.
    assert det.saturation([fresh], 1, 160) == pytest.approx(0.6 / 0.95)
    # 1 request of 960 tokens: 0.5 + 0.6 = 1.1 -> 0.1 of the KV (160 tokens) overflows, 1/6 of
    # the request waiting.
    assert det.saturation([fresh], 1, 960) == pytest.approx(max(1 / 6, 1 / 0.95))
    unknown = EndpointState(kv_usage=0.5, age_s=0.0, is_stale=False)
    assert det.saturation([unknown], 1, 160) == pytest.approx(0.5 / 0.95 + 1.0)


def test_concurrency_tokens_count_output_against_the_engines_kv_size():
    """`outputTokens` adds each in-flight request's output to its prompt tokens (the engine
    holds KV for both); `kvCacheFraction` takes each endpoint's ceiling from its reported KV
    size, so endpoints of different sizes are each measured against their own."""
    det = ConcurrencyDetector(
        ConcurrencyDetector.Params(concurrencyMode="tokens", outputTokens=100, kvCacheFraction=1.0)
    )
    big = EndpointState(inflight_requests=2, inflight_tokens=600, kv_block_size=16, kv_blocks=100)
    small = EndpointState(inflight_requests=1, inflight_tokens=300, kv_block_size=16, kv_blocks=50)
    # big: (600 + 2 x 100) / 1600 = 0.5; small: (300 + 100) / 800 = 0.5
    assert det.saturation([big, small], 0, 0) == pytest.approx(0.5)
    # Pending work (prompt + output already) is spread evenly: +800 each.
    assert det.saturation([big, small], 2, 1600) == pytest.approx((1600 / 1600 + 1200 / 800) / 2)
    assert det.unknown_capacity == 0
    # A fraction above 1 reads the ceiling in the picker's units when its estimate runs
    # above the engine's token count.
    scaled = ConcurrencyDetector(
        ConcurrencyDetector.Params(concurrencyMode="tokens", outputTokens=100, kvCacheFraction=1.25)
    )
    assert scaled.saturation([big], 0, 0) == pytest.approx(800 / 2000)


def test_concurrency_unknown_kv_size_counts_saturated_and_says_so(caplog):
    det = ConcurrencyDetector(
        ConcurrencyDetector.Params(concurrencyMode="tokens", kvCacheFraction=1.0)
    )
    known = EndpointState(inflight_tokens=400, kv_block_size=16, kv_blocks=100)
    with caplog.at_level("WARNING", logger="extproc.flowcontrol"):
        # The unscraped endpoint is full (1.0), never empty: (0.25 + 1.0) / 2.
        assert det.saturation([known, EndpointState()], 0, 0) == pytest.approx(0.625)
        det.saturation([known, EndpointState()], 0, 0)
    assert det.unknown_capacity == 1
    assert sum("KV size of 1 endpoint(s) unknown" in r.getMessage() for r in caplog.records) == 1
    det.saturation([known, known], 0, 0)
    assert det.unknown_capacity == 0
