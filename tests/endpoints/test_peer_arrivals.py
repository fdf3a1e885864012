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


def test_shared_lane_without_own_tokens_drains_as_the_peers_lane():
    p = PeerArrivals()
    p.update({A: 1000}, now=0.0, own={})
    p.update({A: 2000}, now=0.5, own={B: 800})  # own work elsewhere is not in A's lane
    for now in (0.5, 0.8, 1.0, 1.7, 3.0):
        assert p.pending_shared(A, now, tps=1000.0) == p.pending(A, now, tps=1000.0)
    assert p.pending_shared(B, 0.5, tps=1000.0) == 0.0  # no peers there


def test_own_tokens_ahead_delay_the_peers_drain():
    p = PeerArrivals()
    # This replica placed 2,000 tokens on A, then the peers 1,000 (the next exchange).
    p.update({}, now=0.0, own={A: 2000})
    p.update({A: 1000}, now=0.5, own={A: 2000})
    # A peers-only lane has computed 500 of theirs by 1.0 s; the shared one is still on the
    # own 2,000 (done at 2.0 s), so all 1,000 of the peers' are ahead.
    assert p.pending(A, 1.0, tps=1000.0) == pytest.approx(500.0)
    assert p.pending_shared(A, 1.0, tps=1000.0) == pytest.approx(1000.0)
    assert p.pending_shared(A, 2.5, tps=1000.0) == pytest.approx(500.0)
    assert p.pending_shared(A, 3.0, tps=1000.0) == 0.0
    # Own tokens arriving after the peers' are behind them: they delay nothing.
    q = PeerArrivals()
    q.update({A: 1000}, now=0.0, own={})
    q.update({A: 1000}, now=0.5, own={A: 5000})
    assert q.pending_shared(A, 0.6, tps=1000.0) == pytest.approx(q.pending(A, 0.6, tps=1000.0))
    # Own growth at the same exchange goes ahead of the peers'.
    r = PeerArrivals()
    r.update({A: 1000}, now=0.0, own={A: 1000})
    assert r.pending(A, 0.5, tps=1000.0) == pytest.approx(500.0)
    assert r.pending_shared(A, 0.5, tps=1000.0) == pytest.approx(1000.0)
    assert r.pending_shared(A, 1.5, tps=1000.0) == pytest.approx(500.0)


def test_own_tokens_that_end_leave_the_shared_lane():
    p = PeerArrivals()
    p.update({}, now=0.0, own={A: 2000})
    p.update({A: 1000}, now=0.5, own={})  # the own request ended: nothing of it ahead
    assert p.pending_shared(A, 1.0, tps=1000.0) == pytest.approx(p.pending(A, 1.0, tps=1000.0))
    # Without `own` the own arrivals stay as they were; `clear` drops only the peers'.
    q = PeerArrivals()
    q.update({}, now=0.0, own={A: 3000})
    q.update({A: 1000}, now=1.0)
    assert q.pending(A, 2.0, tps=1000.0) == 0.0
    assert q.pending_shared(A, 2.0, tps=1000.0) == pytest.approx(1000.0)  # own until 3.0 s
    q.clear()
    assert q.pending_shared(A, 2.0, tps=1000.0) == 0.0
    q.update({A: 100}, now=2.0)
    assert q.pending_shared(A, 2.5, tps=1000.0) == pytest.approx(100.0)  # own until 3.0 s
    assert q.pending_shared(A, 3.1, tps=1000.0) == 0.0


def test_an_arrival_and_an_end_in_one_interval_are_dated_from_the_placed_tokens():
    # A peer's 1,000-token request from 0 s ends while another 1,000 arrive before the next
    # exchange: the total does not move. Dated by its growth, the new tokens would pass for
    # the old ones, computed long ago; the placed tokens date them now.
    p = PeerArrivals()
    p.update({A: 1000}, now=0.0, arrived={A: 1000})
    p.update({A: 1000}, now=5.0, arrived={A: 1000})
    assert p.total(A) == 1000
    assert p.pending(A, 5.0, tps=1000.0) == pytest.approx(1000.0)
    assert p.pending(A, 5.5, tps=1000.0) == pytest.approx(500.0)
    # The growth alone (a peer of an older version) hides it, as before.
    old = PeerArrivals()
    old.update({A: 1000}, now=0.0)
    old.update({A: 1000}, now=5.0)
    assert old.pending(A, 5.0, tps=1000.0) == 0.0


def test_placed_tokens_that_also_ended_in_the_interval_leave_nothing_behind():
    p = PeerArrivals()
    p.update({A: 300}, now=0.0, arrived={A: 300})
    # 500 placed and 800 ended (the 300 and all 500) by 1 s; 200 more placed on B.
    p.update({B: 200}, now=1.0, arrived={A: 500, B: 200})
    assert p.total(A) == 0 and p.pending(A, 1.0, tps=1.0) == 0.0
    assert p.pending(B, 1.0, tps=1000.0) == pytest.approx(200.0)
    # Fewer placed than the growth (part of the fleet without counters): the growth counts.
    p.update({B: 700}, now=2.0, arrived={B: 100})
    assert p.pending(B, 2.0, tps=0.0) == pytest.approx(700.0)
    assert p.pending(B, 2.0, tps=1000.0) == pytest.approx(500.0)  # 500 dated 2.0 s


def test_own_placed_tokens_date_the_own_arrivals_in_the_shared_lane():
    p = PeerArrivals()
    p.update({}, now=0.0, own={A: 2000}, own_arrived={A: 2000})
    # At 3 s the own request ended and another 2,000 were placed; the peers' 1,000 too.
    p.update({A: 1000}, now=3.0, own={A: 2000}, own_arrived={A: 2000}, arrived={A: 1000})
    # The own 2,000 are young (ahead of the peers' at one exchange): at 3.5 s all 1,000 of
    # the peers' still wait.
    assert p.pending_shared(A, 3.5, tps=1000.0) == pytest.approx(1000.0)
    old = PeerArrivals()
    old.update({}, now=0.0, own={A: 2000})
    old.update({A: 1000}, now=3.0, own={A: 2000})
    assert old.pending_shared(A, 3.5, tps=1000.0) == pytest.approx(500.0)


def test_since_sums_the_arrivals_after_a_time_until_they_are_released():
    p = PeerArrivals()
    p.update({A: 1000}, now=10.0)  # the exchange brought 1,000
    p.arrive(A, 300, at=10.2)  # a pushed placement, dated by its decision
    p.arrive(A, 200, at=10.3)
    assert p.since(A, 10.25) == 200.0  # placed after a scrape at 10.25
    assert p.since(A, 10.1) == 500.0
    assert p.since(A, 9.0) == 1500.0 and p.since(B, 9.0) == 0.0
    # An arrival dated before the youngest one there queues at its time, not earlier.
    p.arrive(A, 50, at=10.0)
    assert p.since(A, 10.25) == 250.0
    # Ends release the oldest first: what the exchange brought at 10.0 goes, the recent stay.
    p.update({A: 550}, now=10.4)
    assert p.since(A, 9.0) == 550.0 and p.since(A, 10.25) == 250.0


def test_placed_counts_every_arrival_once_whatever_ended():
    # What the peers had computed on an endpoint (predicted TTFT's `writtenPlacements:
    # fleet`): exchanged, pushed, or dated by growth, each token once; ends take nothing off.
    p = PeerArrivals()
    p.update({A: 1000}, now=0.0, arrived={A: 1000})
    p.arrive(A, 300, at=0.2)  # pushed: the next exchange does not bring it again
    p.update({A: 300}, now=1.0, arrived={})  # the first 1,000 ended
    assert p.placed(A) == 1300.0 and p.total(A) == 300
    p.update({A: 800, B: 100}, now=2.0)  # an older peer: its growth arrives
    assert p.placed(A) == 1800.0 and p.placed(B) == 100.0
    p.clear()  # Redis gone: the in-flight counts go, what was computed stays
    assert p.placed(A) == 1800.0
    assert p.placed("10.0.0.3:8000") == 0.0
