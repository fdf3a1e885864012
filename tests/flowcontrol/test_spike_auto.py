"""`auto` for the spike reserve's settings (flowcontrol/spike_auto.py): a picker that keeps
a spike term gets the joint reserve at the 0.95 quantile with the `started` credit, alone or
sharing flow state with peers; without a spike term the added term at 0.9 with the rate
credit; explicit values stay; the start line says what `auto` became and why."""

from __future__ import annotations

import logging

import pytest

from extproc.config import build_configured_flow_control, decode_settings
from extproc.flowcontrol.admission import Admission
from extproc.flowcontrol.objectives import Objectives
from extproc.flowcontrol.refill import StartedRefill
from extproc.flowcontrol.spike_auto import SpikeSettings, resolve


def test_auto_is_the_joint_reserve_wherever_a_spike_term_is_kept():
    kept = resolve("auto", "auto", "auto", spike_s=0.3)
    assert (kept.joint, kept.quantile, kept.credit) == (True, 0.95, "started")
    assert kept.reason == "a spike term kept (reserve_spike_s)"
    off = resolve("auto", "auto", "auto", spike_s=0.0)
    assert (off.joint, off.quantile, off.credit) == (False, 0.9, "rate")


def test_explicit_values_are_kept():
    assert resolve(False, "auto", "auto", spike_s=0.3) == SpikeSettings(
        False, 0.9, "rate", "a spike term kept (reserve_spike_s)"
    )
    kept = resolve("auto", 0.97, "predicted", spike_s=0.3)
    assert (kept.joint, kept.quantile, kept.credit) == (True, 0.97, "predicted")
    # Joint asked for without a spike term: its companions keep the old defaults (not
    # measured so).
    asked = resolve(True, "auto", "auto", spike_s=0.0)
    assert (asked.joint, asked.quantile, asked.credit) == (True, 0.9, "rate")


@pytest.mark.parametrize("spike_s", [0.3, 0.0])
def test_the_admission_builds_what_auto_resolved_to_and_says_so(caplog, spike_s):
    doc = {
        "flow_control": {
            "admit_per_endpoint": True,
            "reserve_for_higher_bands": 1,
            "reserve_refill_s": 0.3,
            "reserve_spike_s": spike_s,
        }
    }
    cfg = build_configured_flow_control(decode_settings(doc))
    assert cfg is not None
    with caplog.at_level(logging.INFO, logger="extproc.flowcontrol"):
        adm = Admission(cfg, lambda: [], objectives=Objectives(table={}))
    joint = bool(spike_s)
    assert isinstance(adm.controller.refill, StartedRefill) is joint
    if joint:
        reserve = adm.controller.reserve
        reserve.note(10, 1000, 0)
        # A lone request's clump is itself (joint).
        assert reserve.spike(10) == 1000
    line = next(r.getMessage() for r in caplog.records if "flow_control auto" in r.getMessage())
    if joint:
        want = (
            "reserve_spike_joint true, reserve_spike_quantile 0.95, reserve_refill_credit started"
        )
        assert want in line and "a spike term kept" in line
    else:
        want = "reserve_spike_joint false, reserve_spike_quantile 0.9, reserve_refill_credit rate"
        assert want in line and "no spike term" in line
