"""`auto` for the spike reserve's settings (flowcontrol/spike_auto.py): a picker that keeps
a spike term and shares no flow state gets the joint reserve at the 0.95 quantile with the
`started` credit; with peers, or without a spike term, the added term at 0.9 with the rate
credit; explicit values stay; the start line says what `auto` became and why."""

from __future__ import annotations

import logging

import pytest

from extproc.config import build_configured_flow_control, decode_settings
from extproc.flowcontrol.admission import Admission
from extproc.flowcontrol.objectives import Objectives
from extproc.flowcontrol.refill import StartedRefill
from extproc.flowcontrol.spike_auto import SpikeSettings, resolve


def test_auto_is_the_joint_reserve_only_for_a_picker_alone_with_a_spike_term():
    alone = resolve("auto", "auto", "auto", spike_s=0.3, shared_state=False)
    assert (alone.joint, alone.quantile, alone.credit) == (True, 0.95, "started")
    peers = resolve("auto", "auto", "auto", spike_s=0.3, shared_state=True)
    assert (peers.joint, peers.quantile, peers.credit) == (False, 0.9, "rate")
    assert peers.reason == "flow state shared with peers"
    off = resolve("auto", "auto", "auto", spike_s=0.0, shared_state=False)
    assert (off.joint, off.quantile, off.credit) == (False, 0.9, "rate")


def test_explicit_values_are_kept():
    assert resolve(False, "auto", "auto", spike_s=0.3, shared_state=False) == SpikeSettings(
        False, 0.9, "rate", "one picker: no shared flow state"
    )
    kept = resolve("auto", 0.97, "predicted", spike_s=0.3, shared_state=False)
    assert (kept.joint, kept.quantile, kept.credit) == (True, 0.97, "predicted")
    # Joint asked for on replicas: its companions keep the old defaults (not measured so).
    asked = resolve(True, "auto", "auto", spike_s=0.3, shared_state=True)
    assert (asked.joint, asked.quantile, asked.credit) == (True, 0.9, "rate")


@pytest.mark.parametrize("shared", [False, True])
def test_the_admission_builds_what_auto_resolved_to_and_says_so(caplog, shared):
    doc = {
        "flow_control": {
            "admit_per_endpoint": True,
            "reserve_for_higher_bands": 1,
            "reserve_refill_s": 0.3,
            "reserve_spike_s": 0.3,
        }
    }
    cfg = build_configured_flow_control(decode_settings(doc))
    assert cfg is not None
    with caplog.at_level(logging.INFO, logger="extproc.flowcontrol"):
        adm = Admission(cfg, lambda: [], objectives=Objectives(table={}), shared_state=shared)
    reserve = adm.controller.reserve
    reserve.note(10, 1000, 0)
    # A lone request's clump is itself when joint; added, nothing came before it.
    assert reserve.spike(10) == (0 if shared else 1000)
    assert isinstance(adm.controller.refill, StartedRefill) is not shared
    line = next(r.getMessage() for r in caplog.records if "flow_control auto" in r.getMessage())
    if shared:
        want = "reserve_spike_joint false, reserve_spike_quantile 0.9, reserve_refill_credit rate"
        assert want in line and "shared with peers" in line
    else:
        want = (
            "reserve_spike_joint true, reserve_spike_quantile 0.95, reserve_refill_credit started"
        )
        assert want in line and "no shared flow state" in line
