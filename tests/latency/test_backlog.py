"""The queue of our placements closed by the engine's first-token count: what it prices,
what it drops, and how it sees a server slow down before the histogram fit does."""

from __future__ import annotations

import pytest

from extproc.core import EndpointState
from extproc.latency import LatencyModel
from extproc.latency.backlog import Backlog
from tests.latency.synthetic import Engine, teach

PRICES = (0.002, 0.0002)  # 2 ms a request, 5,000 tokens/s


def test_first_tokens_finish_the_oldest_placements_and_the_rest_is_priced() -> None:
    b = Backlog()
    b.sync(10, 0, 0, at=0.0)  # the engine's count before anything of ours
    for i in range(3):
        b.place(1000, now=0.0 + i * 0.001)
    # Nothing finished yet: three prefills of 0.202 s ahead, the head started at 0.
    work, pace = b.work_s(*PRICES, now=0.1)
    assert pace == 1.0
    assert work == pytest.approx(3 * 0.202 - 0.1)
    b.sync(11, 1, 1, at=0.25)  # one first token between the scrapes at 0 and 0.25
    assert len(b) == 2
    work, _ = b.work_s(*PRICES, now=0.25)
    # The next one started halfway between the scrapes (0.125).
    assert work == pytest.approx(2 * 0.202 - 0.125)
    b.sync(13, 0, 1, at=0.6)
    assert len(b) == 0 and b.tokens == 0.0
    assert b.work_s(*PRICES, now=0.6) == (0.0, 1.0)


def test_placements_the_engine_does_not_hold_are_dropped() -> None:
    """A request that failed before its first token never shows in the count: the engine's
    waiting + running bounds what can still be ours (young placements may be in transit)."""
    b = Backlog()
    b.sync(0, 0, 0, at=0.0)
    for _ in range(4):
        b.place(500, now=1.0)
    b.place(500, now=2.0)
    b.sync(0, 1, 1, at=2.01)  # the engine holds 2; the newest is still on its way
    assert len(b) == 3 and b.trimmed == 2
    b.sync(0, 0, 0, at=0.0)  # a restart (the count went back): nothing is compared
    assert len(b) == 3


def test_a_prefill_slower_than_its_price_raises_the_pace_and_a_refit_takes_it_back() -> None:
    b = Backlog()
    b.sync(0, 0, 0, at=0.0)
    b.place(2000, now=0.0)  # priced 0.402 s
    b.place(2000, now=0.0)
    # The first ended somewhere between 0 and 1.25: too vague to time.
    b.sync(1, 1, 1, at=1.25, prices=PRICES)
    assert b.timed == 0
    b.sync(1, 1, 1, at=1.3, prices=PRICES)
    # The second: started ~0.625, ended ~1.4 (0.775 s, x1.9).
    b.sync(2, 0, 1, at=1.5, prices=PRICES)
    assert b.timed == 1
    assert b.pace == pytest.approx(1.0 + 0.5 * (0.775 / 0.402 - 1.0), rel=0.01)
    slow = b.pace
    # The histogram fit has learned it since: prices x1.9, so the pace left is about 1.
    _, pace = b.work_s(PRICES[0] * slow, PRICES[1] * slow, now=1.5)
    assert pace == pytest.approx(1.0)
    # Timing noise never says "faster" (that is the fit's to learn).
    b.place(2000, now=2.0)
    b.sync(2, 0, 1, at=2.0, prices=PRICES)
    b.sync(2, 0, 1, at=2.2, prices=PRICES)
    b.sync(3, 0, 0, at=2.3, prices=PRICES)  # ~0.25 s for 0.402 s of work
    assert b.pace >= 1.0


def test_a_head_running_late_shows_the_slowdown_before_it_ends() -> None:
    b = Backlog()
    b.sync(0, 0, 0, at=0.0)
    b.place(2000, now=0.0)  # priced 0.402 s
    b.place(2000, now=0.0)
    on_time, pace = b.work_s(*PRICES, now=0.2)
    assert pace == 1.0 and on_time == pytest.approx(0.804 - 0.2)
    b.sync(0, 1, 1, at=1.2)  # still running three times its price
    late, pace = b.work_s(*PRICES, now=1.2)
    assert pace == pytest.approx(1.2 / 0.402)
    # The second is priced at that pace; the head is done for all we know.
    assert late == pytest.approx(0.402 * pace)


def test_the_model_predicts_a_slowed_server_from_its_first_timed_prefill() -> None:
    """Server speed x1/3 mid-run: the prediction for a new request follows once one of our
    prefills has been timed, long before the histogram fit has its intervals."""
    t = [100.0]
    model = LatencyModel(clock=lambda: t[0])
    eng = Engine()
    teach(model, "a:1", eng)
    c = model.coefficients("a:1")
    assert c is not None
    idle = EndpointState(is_stale=False, age_s=0.0)
    before = model.predict("a:1", idle, 2000, t[0])
    assert before is not None
    model.learn("a:1", eng.totals, 0, 0, at=t[0])
    model.place("a:1", 2000, t[0])
    # It takes three times its price (scrapes every 50 ms); the engine's histograms show
    # the same prefill when it ends.
    eng.per_request_s *= 3
    eng.per_token_s *= 3
    slow = 3 * c.prefill_s(2000)
    while t[0] < 100.0 + slow:
        t[0] += 0.05
        model.learn("a:1", eng.totals, 1, 0, at=t[0])
    t[0] += 0.05
    model.learn("a:1", eng.interval([2000], running=1), 1, 0, at=t[0])
    after = model.predict("a:1", idle, 2000, t[0])
    assert after is not None
    # One timed sample moves the pace halfway (x2, against the prices it was timed at); the
    # fit moved too, and the pace left is only what the fit has not learned.
    assert next(iter(model.backlogs().values())).pace == pytest.approx(2.0, rel=0.05)
    assert after.ttft_s > 2.0 * before.ttft_s
