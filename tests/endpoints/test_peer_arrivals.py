"""The peers' in-flight tokens as dated arrivals: growth arrives, falls release the oldest,
and `pending` is what a prefill lane at a given speed has not computed since."""

from __future__ import annotations

import pytest

from extproc.endpoints.peer_arrivals import PeerArrivals

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def test_growth_arrives_and_drains_at_the_lanes_speed():
    p = PeerArrivals()
    p.update({A: 2000}, now=10.0)
    assert p.total(A) == 2000
    assert p.pending(A, 10.0, tps=1000.0) == 2000.0
    assert p.pending(A, 10.5, tps=1000.0) == pytest.approx(1500.0)
    assert p.pending(A, 12.0, tps=1000.0) == 0.0  # computed; still in flight (decoding)
    assert p.total(A) == 2000
    # A later arrival queues behind nothing left: only its own tokens are ahead.
    p.update({A: 3000}, now=12.0)
    assert p.pending(A, 12.0, tps=1000.0) == pytest.approx(1000.0)
    assert p.pending(B, 12.0, tps=1000.0) == 0.0 and p.total(B) == 0


def test_arrivals_close_together_queue_behind_each_other():
    p = PeerArrivals()
    p.update({A: 1000}, now=0.0)
    p.update({A: 2000}, now=0.5)  # 500 of the first left at 0.5 s: 1,500 ahead
    assert p.pending(A, 0.5, tps=1000.0) == pytest.approx(1500.0)
    assert p.pending(A, 1.0, tps=1000.0) == pytest.approx(1000.0)
    assert p.pending(A, 2.0, tps=1000.0) == 0.0


def test_a_fall_releases_the_oldest_first():
    p = PeerArrivals()
    p.update({A: 1000}, now=0.0)
    p.update({A: 1500}, now=5.0)
    p.update({A: 500}, now=5.0)  # the old request ended: what is left is the young one
    assert p.total(A) == 500
    assert p.pending(A, 5.0, tps=1000.0) == pytest.approx(500.0)
    p.update({A: 200}, now=5.0)  # part of an arrival (several requests in one growth)
    assert p.pending(A, 5.0, tps=1000.0) == pytest.approx(200.0)
    p.update({}, now=5.0)  # all ended
    assert p.total(A) == 0 and p.pending(A, 5.0, tps=1000.0) == 0.0
    p.update({A: 100}, now=6.0)  # a new arrival starts from nothing
    assert p.pending(A, 6.0, tps=1000.0) == pytest.approx(100.0)


def test_clear_forgets_and_many_arrivals_stay_bounded():
    p = PeerArrivals(max_arrivals=4)
    for i in range(1, 11):
        p.update({A: 10 * i, B: 5}, now=float(i))
    # Merged into the younger: never less ahead than the arrivals hold.
    assert p.pending(A, 10.0, tps=0.0) == pytest.approx(100.0)
    assert len(p._arrivals[A]) <= 4
    p.clear()
    assert p.total(A) == p.total(B) == 0 and p.pending(A, 10.0, tps=1.0) == 0.0
