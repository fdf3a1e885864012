"""The joint spike (`flow_control.reserve_spike_joint`, flowcontrol/reserve.py): the spike
quantile is taken of each request's clump, what came within the window before it plus its
own tokens, and the reserve is that or the largest request, whichever is more, instead of
the quantile of what came before added to the largest."""

from __future__ import annotations

import logging

from extproc.config import build_configured_flow_control, decode_settings
from extproc.flowcontrol.admission import Admission
from extproc.flowcontrol.objectives import Objectives
from extproc.flowcontrol.reserve import QUANTILE_TRUSTED, Reserve
from tests.flowcontrol.test_reserve_rate import Clock
from tests.flowcontrol.test_reserve_spike import pairs


def test_the_joint_quantile_counts_each_request_with_what_came_before_it():
    clock = Clock()
    added = Reserve(1, clock, spike_s=0.5)
    joint = Reserve(1, clock, spike_s=0.5, spike_joint=True)
    for r in (added, joint):
        pairs(r, clock, QUANTILE_TRUSTED // 2)
    # Clumps: 1,000 alone, then 1,000 + 500. Added: the largest (1,000) and the 1,000
    # that came before half the requests, 2,000; joint: the clump of 1,500.
    assert added.held(0, (10, 0), None) == (2000, 10)
    assert joint.spike(10) == 1500
    assert joint.held(0, (10, 0), None) == (1500, 10)


def test_the_joint_reserve_is_never_below_the_largest_request():
    clock = Clock()
    r = Reserve(1, clock, spike_s=0.3, spike_quantile=0.5, spike_joint=True)
    for i in range(QUANTILE_TRUSTED):  # far apart, mostly small: the median clump is 100
        r.note(10, 2000 if i % 5 == 0 else 100, 0)
        clock.now += 1.0
    assert r.spike(10) == 100
    assert r.held(0, (10, 0), None) == (2000, 10)


def test_the_setting_is_read_and_reaches_the_reserve(caplog):
    s = decode_settings({"flow_control": {"reserve_spike_s": 0.3, "reserve_spike_joint": True}})
    assert s.flow_control is not None and s.flow_control.reserve_spike_joint
    assert decode_settings({"flow_control": {}}).flow_control.reserve_spike_joint == "auto"
    doc = {
        "flow_control": {
            "admit_per_endpoint": True,
            "reserve_for_higher_bands": 1,
            "reserve_spike_s": 0.3,
            "reserve_spike_joint": True,
        }
    }
    cfg = build_configured_flow_control(decode_settings(doc))
    assert cfg is not None
    adm = Admission(cfg, lambda: [], objectives=Objectives(table={}))
    reserve = adm.controller.reserve
    reserve.note(10, 1000, 0)
    assert reserve.spike(10) == 1000  # a lone request's clump is itself: joint (added: 0)
    # Without the window the setting does nothing, and says so.
    doc["flow_control"]["reserve_spike_s"] = 0
    cfg = build_configured_flow_control(decode_settings(doc))
    assert cfg is not None
    with caplog.at_level(logging.WARNING, logger="extproc.flowcontrol"):
        Admission(cfg, lambda: [], objectives=Objectives(table={}))
    assert "reserve_spike_joint has no effect" in caplog.text
