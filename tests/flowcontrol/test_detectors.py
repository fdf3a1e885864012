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
