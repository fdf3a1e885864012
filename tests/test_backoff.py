"""The shared backoff arithmetic (extproc/backoff.py)."""

from __future__ import annotations

import pytest

from extproc.backoff import backoff_s


def test_doubles_from_the_base_up_to_the_cap():
    assert [backoff_s(n, 0.5, 30.0) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_no_failure_no_wait():
    assert backoff_s(0, 0.5, 30.0) == 0.0
    assert backoff_s(-3, 0.5, 30.0) == 0.0


def test_a_huge_failure_count_stays_at_the_cap():
    assert backoff_s(10_000, 0.1, 1.0) == 1.0


@pytest.mark.parametrize(("rand", "factor"), [(0.0, 0.5), (0.5, 0.75), (0.999, 0.9995)])
def test_jitter_scales_into_half_to_whole(rand: float, factor: float):
    assert backoff_s(3, 1.0, 30.0, rand) == pytest.approx(4.0 * factor)
