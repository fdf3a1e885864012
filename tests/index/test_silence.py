"""KV-event silence that contradicts placements (index/silence.py): declared once the
unanswered placements make hearing nothing improbable at the endpoint's learned rate, said
in one line, ended by the next message."""

from __future__ import annotations

import logging

import pytest

from extproc.index.silence import EXPECTED_MESSAGES, PRIOR_PER_PLACEMENT, SilenceWatch
from extproc.testing import ManualClock

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def watch(clock: ManualClock) -> SilenceWatch:
    return SilenceWatch(every_s=1.0, clock=clock)


def answered(w: SilenceWatch, clock: ManualClock, endpoint: str, n: int, per: int = 1) -> None:
    """`n` placements on `endpoint`, each answered by `per` messages 10 ms later."""
    for _ in range(n):
        w.placed(endpoint)
        clock.advance(0.01)
        for _ in range(per):
            w.heard(endpoint)


def test_silence_is_declared_after_the_learned_window_and_logged_once(caplog):
    clock = ManualClock()
    w = watch(clock)
    answered(w, clock, A, 40)  # one message per placement: the window is 8 placements
    for _ in range(7):
        w.placed(A)
    clock.advance(5.0)
    w.check()
    assert not w.view(A).silent  # 7 unanswered placements: 7 expected messages, not yet
    w.placed(A)
    with caplog.at_level(logging.WARNING, logger="extproc.index.silence"):
        w.check()
        w.check()
    assert w.view(A).silent and w.view(A).periods == 1 and w.view(A).unanswered == 8
    lines = [r for r in caplog.records if "no message from" in r.getMessage()]
    assert len(lines) == 1 and A in lines[0].getMessage()


def test_an_endpoint_that_sends_less_per_placement_gets_a_longer_window():
    clock = ManualClock()
    w = watch(clock)
    for _ in range(20):  # about one message per 4 placements
        answered(w, clock, A, 1)
        for _ in range(3):
            w.placed(A)
    w.heard(A)
    # 21 messages for 80 placements: silent after ceil(8 / 0.2625) = 31 (one per placement
    # would take 8).
    for _ in range(30):
        w.placed(A)
    clock.advance(5.0)
    w.check()
    assert not w.view(A).silent
    w.placed(A)
    w.check()
    assert w.view(A).silent


def test_a_recent_slow_answer_makes_the_window_wait_twice_as_long():
    clock = ManualClock()
    w = watch(clock)
    answered(w, clock, A, 20)
    w.placed(A)
    clock.advance(3.0)  # an engine that took 3 s to publish after a placement
    w.heard(A)
    for _ in range(20):
        w.placed(A)
    clock.advance(5.0)
    w.check()
    assert not w.view(A).silent  # 5 s < 2 x 3 s
    clock.advance(1.5)
    w.check()
    assert w.view(A).silent


def test_an_endpoint_never_heard_is_judged_by_the_fleet_then_the_prior():
    clock = ManualClock()
    w = watch(clock)
    answered(w, clock, B, 20, per=2)  # the fleet sends 2 per placement: A's window is 4
    for _ in range(4):
        w.placed(A)
    clock.advance(2.0)
    w.check()
    assert w.view(A).silent and not w.view(B).silent

    alone = watch(clock)  # nothing heard anywhere: the prior
    prior_window = int(EXPECTED_MESSAGES / PRIOR_PER_PLACEMENT)
    for _ in range(prior_window - 1):
        alone.placed(A)
    clock.advance(2.0)
    alone.check()
    assert not alone.view(A).silent
    alone.placed(A)
    alone.check()
    assert alone.view(A).silent


def test_a_message_ends_the_silence_with_a_line_and_only_the_window_is_learned(caplog):
    clock = ManualClock()
    w = watch(clock)
    answered(w, clock, A, 40)
    for _ in range(500):  # a long outage
        w.placed(A)
    clock.advance(5.0)
    w.check()
    assert w.view(A).silent
    clock.advance(10.0)
    with caplog.at_level(logging.INFO, logger="extproc.index.silence"):
        w.heard(A)
    assert w.view(A) == type(w.view(A))(False, 1, 0)
    (line,) = [r for r in caplog.records if "heard again" in r.getMessage()]
    assert "10.0 s silent" in line.getMessage() and "500 placements" in line.getMessage()
    # The outage did not teach A that it sends 1 message per 500 placements, only the
    # window's 8: the next silence is found after 10 placements, not after thousands.
    for _ in range(10):
        w.placed(A)
    clock.advance(5.0)
    w.check()
    assert w.view(A).silent and w.view(A).periods == 2


def test_placements_without_a_message_under_the_time_floor_are_not_silence():
    clock = ManualClock()
    w = watch(clock)
    answered(w, clock, A, 40)
    for _ in range(100):  # a burst decided within 0.5 s: the engine has not stepped yet
        w.placed(A)
    clock.advance(0.5)
    w.check()
    assert not w.view(A).silent


def test_without_judging_unheard_endpoints_only_a_publisher_once_heard_is_flagged():
    clock = ManualClock()
    w = SilenceWatch(every_s=1.0, clock=clock, judge_unheard=False)
    answered(w, clock, B, 20)
    for _ in range(50):
        w.placed(A)  # never heard here: its publisher may feed another replica
        w.placed(B)
    clock.advance(2.0)
    w.check()
    assert list(w.silent()) == [B]


def test_forget_drops_an_endpoint_and_unknown_ones_show_quiet():
    clock = ManualClock()
    w = watch(clock)
    for _ in range(50):
        w.placed(A)
    clock.advance(2.0)
    w.check()
    assert list(w.silent()) == [A]
    w.forget(A)
    assert list(w.silent()) == [] and w.view(A) == type(w.view(A))(False, 0, 0)


@pytest.mark.parametrize("rounds", [3])
async def test_run_checks_every_interval(rounds):
    clock = ManualClock()
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        clock.advance(s)
        if len(slept) > rounds:
            raise StopAsyncIteration

    w = SilenceWatch(every_s=1.0, clock=clock, sleep=sleep)
    for _ in range(50):
        w.placed(A)
    with pytest.raises(StopAsyncIteration):
        await w.run()
    assert slept == [1.0] * (rounds + 1) and w.view(A).silent


# -- fleet-wide judging (replicas sharing one bound address; server/shared_silence.py) ------


class Fleet:
    """What the fleet's news looks like to a watch: arriving or not."""

    ok = True

    def __call__(self) -> bool:
        return self.ok


def fleet_watch(clock: ManualClock, fleet: Fleet) -> SilenceWatch:
    w = SilenceWatch(every_s=1.0, clock=clock, judge_unheard=False)
    w.use_fleet(fleet, lag_s=1.0)
    return w


def test_a_publisher_heard_by_a_peer_only_is_not_silent_here():
    # The replica's publisher of A moved to a peer: heard here once, then only there. Judged
    # alone, A is flagged (a false alarm); judged by the fleet it is not.
    clock, fleet = ManualClock(), Fleet()
    w = fleet_watch(clock, fleet)
    answered(w, clock, A, 20)
    for _ in range(50):
        w.placed(A)
        w.peers_placed(A, 2)
        clock.advance(0.05)
        w.peers_heard(A, 3)  # the peer hears A's answers to the fleet's placements
    clock.advance(3.0)
    w.check()
    assert list(w.silent()) == [] and w.judging_fleet
    # The fleet's news stops (Redis down): judged from its own tally, as without sharing.
    fleet.ok = False
    w.check()
    assert list(w.silent()) == [A] and not w.judging_fleet


def test_a_publisher_silent_from_its_start_is_judged_by_the_fleet():
    # Nobody ever heard B; a peer hears A. Alone, B is never judged (it may feed a peer).
    clock, fleet = ManualClock(), Fleet()
    w = fleet_watch(clock, fleet)
    for _ in range(40):
        w.peers_placed(A, 1)
        w.peers_heard(A, 1)
        w.placed(B)
        w.peers_placed(B, 1)
        clock.advance(0.05)
    # The fleet's rate (one message per placement) sizes B's window: 8 placements, and the
    # time floor is the check interval plus the peers' news lag.
    clock.advance(0.1)
    w.check()
    assert list(w.silent()) == [B]
    v = w.view(B)
    assert v.silent and v.periods == 1 and v.unanswered == 80
    # A peer hearing B ends it.
    w.peers_heard(B, 1)
    assert list(w.silent()) == [] and w.view(B).unanswered == 0


def test_the_time_floor_waits_for_a_peers_answer_in_transit():
    clock, fleet = ManualClock(), Fleet()
    w = fleet_watch(clock, fleet)
    for _ in range(40):
        w.peers_placed(A, 1)
    clock.advance(1.5)  # past the check interval, not past its batch's lag on top
    w.check()
    assert list(w.silent()) == []
    clock.advance(0.6)
    w.check()
    assert list(w.silent()) == [A]


def test_the_fleet_tally_restarts_after_an_outage_instead_of_counting_it():
    clock, fleet = ManualClock(), Fleet()
    w = fleet_watch(clock, fleet)
    answered(w, clock, A, 20)
    fleet.ok = False
    for _ in range(100):
        w.placed(A)
        w.peers_placed(A, 1)  # e.g. pushed before the exchange failed
    clock.advance(2.0)
    w.check()  # judged alone: its own tally flags A (it was heard here)
    assert list(w.silent()) == [A]
    w.heard(A)
    fleet.ok = True
    for _ in range(3):
        w.placed(A)
    clock.advance(5.0)
    w.check()
    assert list(w.silent()) == [] and w.view(A).unanswered == 3


def test_heard_counts_are_taken_once_and_only_with_fleet_judging():
    clock = ManualClock()
    alone = watch(clock)
    alone.heard(A)
    alone.peers_heard(A, 5)
    alone.peers_placed(A, 5)
    assert alone.take_heard() == {} and alone.view(A).unanswered == 0
    w = fleet_watch(clock, Fleet())
    for _ in range(3):
        w.heard(A)
    w.heard(B)
    assert w.take_heard() == {A: 3, B: 1}
    assert w.take_heard() == {}
