"""Holding placements until the access log says the request ended; learned prefill speed."""

from __future__ import annotations

from extproc.endpoints.inflight import InFlight, Placement
from extproc.endpoints.prefill_speed import PrefillSpeeds
from extproc.endpoints.request_end import Ended, RequestEnds, RequestEndSettings


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(mode="auto", **kw):
    inflight, clock = InFlight(), Clock()
    ended: list[tuple[Placement, Ended]] = []
    ends = RequestEnds(
        inflight.release,
        RequestEndSettings(mode=mode, **kw),
        on_end=lambda p, e: ended.append((p, e)),
        clock=clock,
    )
    return inflight, clock, ends, ended


def test_auto_mode_releases_at_stream_end_until_an_access_log_arrives():
    inflight, _, ends, _ = make()
    ends.finish("a", inflight.acquire("s1", 100))
    assert inflight.requests("s1") == 0 and ends.stats.held == 0


def test_a_held_placement_lasts_until_its_log_entry():
    inflight, _, ends, ended = make()
    ends.ended(Ended("warmup"))  # an access-log stream exists
    p = inflight.acquire("s1", 500)
    ends.finish("r1", p)
    assert inflight.requests("s1") == 1 and inflight.tokens("s1") == 500
    ends.ended(Ended("r1", ttfb_s=0.25, upstream="s1"))
    assert inflight.requests("s1") == 0 and inflight.tokens("s1") == 0
    assert ended == [(p, Ended("r1", 0.25, "s1"))]
    assert ends.stats.ended == 1 and ends.stats.held == 0


def test_an_entry_that_beats_its_stream_close_releases_at_once():
    inflight, _, ends, _ = make(mode="access-log")
    ends.ended(Ended("r1"))
    ends.finish("r1", inflight.acquire("s1", 10))
    assert inflight.requests("s1") == 0 and ends.stats.held == 0


def test_a_lost_entry_expires_and_is_counted():
    inflight, clock, ends, _ = make(mode="access-log", max_hold_s=30)
    ends.finish("r1", inflight.acquire("s1", 10))
    clock.t += 29
    assert ends.sweep() == 0 and inflight.requests("s1") == 1
    clock.t += 2
    assert ends.sweep() == 1 and inflight.requests("s1") == 0
    assert ends.stats.expired == 1


def test_held_placements_are_bounded_and_a_reused_id_never_leaks():
    inflight, _, ends, _ = make(mode="access-log", max_held=2)
    for rid in ("a", "b", "c"):
        ends.finish(rid, inflight.acquire("s1", 1))
    assert inflight.requests("s1") == 2 and ends.stats.expired == 1
    ends.finish("c", inflight.acquire("s1", 1))  # same id again: the first is released
    assert inflight.requests("s1") == 2


def test_stream_mode_never_holds():
    inflight, _, ends, _ = make(mode="stream")
    ends.ended(Ended("x"))
    ends.finish("r1", inflight.acquire("s1", 1))
    assert inflight.requests("s1") == 0


def test_prefill_speed_is_the_median_of_tokens_over_ttfb():
    sp = PrefillSpeeds()
    assert sp.get("a") is None
    sp.observe("a", 5000, 1.0)  # 5,000 tok/s
    sp.observe("a", 100, 0.001)  # too few tokens: overhead, skipped
    sp.observe("a", 5000, None)  # no first byte: skipped
    assert sp.get("a") == 5000
    sp.observe("a", 5000, 5.0)  # queued: 1,000 tok/s
    sp.observe("a", 5000, 0.01)  # cached more than credited: 500,000 tok/s
    assert sp.get("a") == 5000  # neither outlier moves the median
    sp.observe("b", 20000, 1.0)
    assert sp.get("c") == 12500  # unmeasured: the fleet's median


def test_prefill_speeds_follow_a_change_of_token_estimates():
    # Calibration made every estimate 4x larger: the speeds learned in the old unit scale
    # with them, and new samples in the new unit join the same window without a jump.
    sp = PrefillSpeeds()
    for _ in range(3):
        sp.observe("a", 5000, 1.0)
    sp.units_changed(4.0)
    assert sp.get("a") == 20000
    sp.observe("a", 20000, 1.0)
    sp.observe("a", 20000, 1.0)
    assert sp.get("a") == 20000


def test_auto_mode_stops_holding_when_entries_are_mostly_for_other_replicas():
    inflight, _, ends, _ = make()
    for i in range(100):
        ends.ended(Ended(f"elsewhere-{i}"))  # another replica's requests
    ends.finish("mine", inflight.acquire("s1", 1))
    assert inflight.requests("s1") == 0  # released at the stream end, not leaked
    ends.on_unmatched = lambda e: None  # shared through Redis: the others release ours
    ends.finish("mine2", inflight.acquire("s1", 1))
    assert inflight.requests("s1") == 1
