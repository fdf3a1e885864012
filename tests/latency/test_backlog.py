"""The queue of our placements closed by the engine's first-token count: what it prices
and what it drops."""

from __future__ import annotations

import pytest

from extproc.core import EndpointState
from extproc.latency import LatencyModel, ModelSettings
from extproc.latency.backlog import Backlog
from tests.latency.synthetic import Engine, teach

PRICES = (0.002, 0.0002)  # 2 ms a request, 5,000 tokens/s


def test_first_tokens_finish_the_oldest_placements_and_the_rest_is_priced() -> None:
    b = Backlog()
    b.sync(10, 0, 0, at=0.0)  # the engine's count before anything of ours
    for i in range(3):
        b.place(1000, now=0.0 + i * 0.001)
    # Nothing finished yet: three prefills of 0.202 s ahead, the head started at 0.
    work = b.work_s(*PRICES, now=0.1)
    assert work == pytest.approx(3 * 0.202 - 0.1)
    b.sync(11, 1, 1, at=0.25)  # one first token between the scrapes at 0 and 0.25
    assert len(b) == 2
    work = b.work_s(*PRICES, now=0.25)
    # The next one started halfway between the scrapes (0.125).
    assert work == pytest.approx(2 * 0.202 - 0.125)
    b.sync(13, 0, 1, at=0.6)
    assert len(b) == 0 and b.tokens == 0.0
    assert b.work_s(*PRICES, now=0.6) == 0.0


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


def test_a_late_head_is_not_credited_past_its_price() -> None:
    b = Backlog()
    b.sync(0, 0, 0, at=0.0)
    b.place(2000, now=0.0)  # priced 0.402 s
    b.place(2000, now=0.0)
    assert b.work_s(*PRICES, now=0.2) == pytest.approx(0.804 - 0.2)
    b.sync(0, 1, 1, at=1.2)  # still running, three times its price
    # The second is still all ahead; the head is done for all we know.
    assert b.work_s(*PRICES, now=1.2) == pytest.approx(0.402)
    assert b.work_s(*PRICES, now=1.3) == pytest.approx(0.302)


def test_the_model_prices_the_queue_the_engine_still_has() -> None:
    """Three of our prefills placed; the engine's first-token count says two are done: the
    prediction carries one (what is left of it), not three, whatever was predicted."""
    t = [100.0]
    model = LatencyModel(clock=lambda: t[0])
    eng = Engine()
    teach(model, "a:1", eng)
    c = model.coefficients("a:1")
    assert c is not None
    idle = EndpointState(is_stale=False, age_s=0.0)
    model.learn("a:1", eng.totals, 0, 0, at=t[0])
    empty = model.predict("a:1", idle, 500, t[0])
    for _ in range(3):
        model.place("a:1", 2000, t[0])
    queued = model.predict("a:1", idle, 500, t[0])
    assert empty is not None and queued is not None
    assert queued.ttft_s - empty.ttft_s == pytest.approx(3 * c.prefill_s(2000))
    t[0] += 0.3
    model.learn("a:1", eng.interval([2000, 2000], running=1), 1, 0, at=t[0])
    c = model.coefficients("a:1")
    assert c is not None
    later = model.predict("a:1", idle, 500, t[0])
    assert later is not None
    # The third started halfway between the scrapes (0.15 s ago).
    assert later.ttft_s - empty.ttft_s == pytest.approx(c.prefill_s(2000) - 0.15, rel=0.05)
    assert len(model.backlogs()["a:1"]) == 1


def test_a_head_past_its_price_bounds_how_much_slower_its_server_is() -> None:
    """A server slowed by another tenant: the fit learns only when a slowed prefill ends,
    but its head, still unfinished at a scrape after its price, shows it earlier. The head
    is timed from the latest moment it can have started (the first scrape that saw it in
    the engine), so the figure is a lower bound on the slowdown."""
    b = Backlog()
    b.sync(0, 0, 0, at=0.0)
    b.place(1000, now=0.0)  # priced 0.202 s
    b.sync(0, 0, 0, at=0.05)  # not in the engine yet (in transit): not timed
    assert b.head_elapsed_s() == 0.0 and b.slowdown(*PRICES) == 1.0
    b.sync(0, 0, 1, at=0.1)  # the engine holds it: started by 0.1 at the latest
    assert b.slowdown(*PRICES) == 1.0
    b.sync(0, 0, 1, at=0.3)  # has run 0.2 s at least: within its price
    assert b.slowdown(*PRICES) == 1.0
    b.sync(0, 0, 1, at=0.9)  # has run 0.8 s at least: four times its price
    assert b.slowdown(*PRICES) == pytest.approx(0.8 / 0.202)
    # Up to 0.1 s of it may be the first token's overhead, and 0.05 s the path to the engine.
    assert b.slowdown(*PRICES, overhead_s=0.1) == pytest.approx(0.7 / 0.202)
    assert b.slowdown(*PRICES, transport_s=0.15) == pytest.approx(0.75 / 0.202)
    b.sync(1, 0, 1, at=1.0)  # its first token: nothing of ours is late
    assert b.slowdown(*PRICES) == 1.0


def test_a_head_only_a_little_late_already_counts() -> None:
    """No margin: 30% past its price, measured from its latest possible start, is 30%
    slower for certain (the old rule waited for 1.5 times the price plus 0.1 s)."""
    b = Backlog()
    b.sync(0, 0, 0, at=0.0)
    b.place(1000, now=0.0)
    b.place(1000, now=0.01)
    b.sync(0, 1, 1, at=0.05)  # the head started by 0.05
    b.sync(0, 1, 1, at=0.05 + 1.3 * 0.202)
    assert b.slowdown(*PRICES) == pytest.approx(1.3)


def test_the_next_head_is_timed_from_the_scrape_that_saw_the_last_one_end() -> None:
    """Scrape jitter can only shorten the timed span: the new head started somewhere
    between the scrapes around its predecessor's first token, and is timed from the later."""
    b = Backlog()
    b.sync(0, 0, 0, at=0.0)
    for _ in range(3):
        b.place(1000, now=0.0)
    b.sync(0, 2, 1, at=0.1)
    b.sync(1, 1, 1, at=0.5)  # the first ended between 0.1 and 0.5
    assert b.head_elapsed_s() == 0.0
    b.sync(1, 1, 1, at=0.7)
    assert b.head_elapsed_s() == pytest.approx(0.2)
    assert b.slowdown(*PRICES) == 1.0  # 0.2 s of a 0.202 s price: not late yet
    # Pricing what is left still uses the best guess of its start (halfway, 0.3).
    assert b.work_s(*PRICES, now=0.7) == pytest.approx(2 * 0.202 - 0.202)


def test_the_model_prices_an_endpoint_at_its_late_heads_speed() -> None:
    clock = [100.0]
    model = LatencyModel(clock=lambda: clock[0])
    eng = Engine()
    teach(model, "a:1", eng)
    state = EndpointState(is_stale=False, running=1)
    fit = model.predict("a:1", state, 1000, now=clock[0])
    assert fit is not None
    model.place("a:1", 1000, now=clock[0])
    clock[0] += 0.05
    model.learn("a:1", eng.totals, running=1, waiting=0, at=clock[0])  # the engine has it
    clock[0] += 0.3  # 1.5 times its price, not yet its first token: 1.5 times slower
    model.learn("a:1", eng.totals, running=1, waiting=0, at=clock[0])
    slower = model.predict("a:1", state, 1000, now=clock[0])
    assert slower is not None and slower.prefill_s == pytest.approx(0.3, rel=0.05)
    clock[0] += 0.65  # the placement's first token never came: the server slowed ~4x
    model.learn("a:1", eng.totals, running=1, waiting=0, at=clock[0])
    late = model.predict("a:1", state, 1000, now=clock[0])
    assert late is not None and late.ttft_s > 3 * fit.ttft_s
    assert model.stats.late_heads == 2
    off = LatencyModel(ModelSettings(late_heads=False), clock=lambda: clock[0])
    other = Engine()
    teach(off, "a:1", other)
    off.place("a:1", 1000, now=clock[0] - 1.0)
    off.learn("a:1", other.totals, running=1, waiting=0, at=clock[0])
    unchanged = off.predict("a:1", state, 1000, now=clock[0])
    assert unchanged is not None and unchanged.ttft_s < 2 * fit.ttft_s


def test_a_late_heads_endpoint_is_priced_at_the_slowdown_its_decode_steps_show() -> None:
    """The head's bound grows with the time it runs: 10% late proves 1.1 times slower,
    while the server (another tenant on its GPU) is 1.4 times slower, and every request
    queued there is priced short by the rest. Its decode steps have shown the factor since
    the first slowed token (`decodeSlowdown`; main's code, and the default: priced at the
    bound). 1.4 times alone is not far enough off to count without the head's proof."""
    clock = [100.0]
    model = LatencyModel(ModelSettings(decode_slowdown=True), clock=lambda: clock[0])
    eng = Engine()
    teach(model, "a:1", eng)
    state = EndpointState(is_stale=False, running=4)
    fit = model.predict("a:1", state, 1000, now=clock[0])
    assert fit is not None
    for _ in range(5):
        model.place("a:1", 1000, now=clock[0])
    clock[0] += 0.05
    model.learn("a:1", eng.totals, running=4, waiting=1, at=clock[0])  # under way
    eng.itl_base_s, eng.itl_per_seq_s = eng.itl_base_s * 1.4, eng.itl_per_seq_s * 1.4
    for _ in range(3):  # decode steps 1.4 times slower; the head is within its price
        clock[0] += 0.05
        model.learn("a:1", eng.decode(20), running=4, waiting=4, at=clock[0])
    early = model.predict("a:1", state, 1000, now=clock[0])
    assert early is not None and early.prefill_s == pytest.approx(fit.prefill_s, rel=0.01)
    clock[0] = 100.05 + 1.1 * fit.prefill_s  # 1.1 times its price: late, for certain
    model.learn("a:1", eng.decode(20), running=4, waiting=4, at=clock[0])
    late = model.predict("a:1", state, 1000, now=clock[0])
    assert late is not None
    assert late.prefill_s == pytest.approx(1.4 * fit.prefill_s, rel=0.03)
    assert model.stats.decode_priced == 1


def test_decode_steps_price_the_slowdown_before_a_head_is_late_only_when_asked() -> None:
    """`decodeSlowdown`: the decode steps' slowdown, far off (here 3 times), prices the
    endpoint before any head is late once it is the median of the last three intervals
    (one slowed interval after a normal one does not; two do); by default the decode
    steps move nothing."""
    seen: dict[bool, list[float]] = {}
    for on in (False, True):
        clock = [100.0]
        model = LatencyModel(ModelSettings(decode_slowdown=on), clock=lambda c=clock: c[0])
        eng = Engine()
        teach(model, "a:1", eng)
        model.place("a:1", 1000, now=clock[0])
        clock[0] += 0.05
        model.learn("a:1", eng.totals, running=4, waiting=1, at=clock[0])
        eng.itl_base_s, eng.itl_per_seq_s = eng.itl_base_s * 3, eng.itl_per_seq_s * 3
        seen[on] = []
        for _ in range(3):
            clock[0] += 0.05
            model.learn("a:1", eng.decode(20), running=4, waiting=1, at=clock[0])
            p = model.predict("a:1", EndpointState(is_stale=False), 1000, clock[0])
            assert p is not None
            seen[on].append(p.prefill_s)
    fit = seen[False][0]
    assert seen[False] == pytest.approx([fit] * 3)
    assert seen[True] == pytest.approx([fit, 3 * fit, 3 * fit], rel=0.05)
