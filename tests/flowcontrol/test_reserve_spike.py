"""The reserve's spike term (`flow_control.reserve_spike_s`, flowcontrol/reserve.py): the
arrival-rate term is instead a quantile of the tokens a higher band sent within a window
before each of its recent requests, so the room covers the work that comes close behind
another, not the band's mean rate."""

from __future__ import annotations

import logging

import pytest

from extproc.config import decode_settings
from extproc.errors import ConfigError
from extproc.flowcontrol.reserve import QUANTILE_TRUSTED, Reserve
from tests.flowcontrol.test_reserve_rate import Clock


def pairs(r: Reserve, clock: Clock, n: int, gap_s: float = 0.1, every_s: float = 2.0) -> None:
    """`n` pairs of the band's requests: 1,000 tokens, then 500 `gap_s` later; a pair
    every `every_s`."""
    for _ in range(n):
        r.note(10, 1000, 0)
        clock.now += gap_s
        r.note(10, 500, 0)
        clock.now += every_s - gap_s


def test_the_spike_is_a_quantile_of_what_came_close_before_each_request():
    clock = Clock()
    r = Reserve(1, clock, spike_s=0.5, spike_quantile=0.9)
    pairs(r, clock, QUANTILE_TRUSTED // 2)
    # Half the requests had the pair's 1,000 within 0.5 s before them, half nothing.
    assert r.spike(10) == 1000
    assert Reserve(1, clock, spike_s=0.5, spike_quantile=0.5).spike(10) == 0  # no history
    median = Reserve(1, clock, spike_s=0.5, spike_quantile=0.5)
    pairs(median, clock, QUANTILE_TRUSTED // 2)
    assert median.spike(10) == 0
    # Outside the window: nothing came close.
    wide = Reserve(1, clock, spike_s=0.05)
    pairs(wide, clock, QUANTILE_TRUSTED // 2)
    assert wide.spike(10) == 0


def test_the_spike_replaces_the_rate_term_once_the_history_is_trusted(caplog):
    clock = Clock()
    r = Reserve(1, clock, spike_s=0.5)
    pairs(r, clock, QUANTILE_TRUSTED // 2 - 1)
    caplog.set_level(logging.INFO, logger="extproc.flowcontrol")
    # Short of 20 requests: the mean rate's term, at 5,000 tokens/s over the largest's
    # 1,000-token prefill (0.2 s).
    assert r.held(0, (10, 0), 5000.0)[0] == 1000 + int(r.rate(10) * 1000 / 5000.0)
    assert not r.spike_on and "spike term" not in caplog.text
    pairs(r, clock, 1)
    assert r.held(0, (10, 0), 5000.0) == (2000, 10)  # the largest + the spike
    assert r.held(0, (10, 0), None) == (2000, 10)  # no speed needed
    # The switch is said once (the sizing runs at every dispatch opportunity).
    assert r.spike_on == {10}
    said = [m for m in caplog.messages if "now sized by its spike term" in m]
    assert said == ["reserve for band 10 now sized by its spike term (20 arrivals within "
                    "0.50 s, the fleet's); before, by its mean arrival rate"]  # fmt: skip


def test_the_spike_figures_leave_with_their_requests():
    clock = Clock()
    r = Reserve(1, clock, spike_s=0.5)
    pairs(r, clock, 50)  # 100 requests: the history is full
    for _ in range(100):  # then lone requests, far apart: nothing close before any
        r.note(10, 1000, 0)
        clock.now += 2.0
    assert r.spike(10) == 0


def test_the_settings_are_read_and_bounded():
    s = decode_settings({"flow_control": {"reserve_spike_s": 0.5}})
    assert s.flow_control is not None
    # The quantile's default is `auto` (0.9 beside the added term: flowcontrol/spike_auto.py).
    assert (s.flow_control.reserve_spike_s, s.flow_control.reserve_spike_quantile) == (0.5, "auto")
    for bad in ({"reserve_spike_s": -1}, {"reserve_spike_quantile": 0}):
        with pytest.raises(ConfigError):
            decode_settings({"flow_control": bad})
    with pytest.raises(ValueError):
        Reserve(1, Clock(), spike_s=0.5, spike_quantile=1.5)
