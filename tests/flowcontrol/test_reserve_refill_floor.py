"""A floor under the refill credit (`flow_control.reserve_refill_floor`, opt-in): a
server keeps at least that share of the reserve for higher bands however much room it is
expected to free, so the credit cannot lend out nearly all of it (bench/RESULTS.md,
twenty-sixth session: `started` credits reached 3,234 of a 3,257 reserve)."""

from __future__ import annotations

import logging

import pytest

from extproc.config import build_configured_flow_control, decode_settings
from extproc.errors import ConfigError
from extproc.flowcontrol.admission import Admission
from extproc.flowcontrol.config import FlowControlSettings
from extproc.flowcontrol.controller import FlowController
from extproc.flowcontrol.objectives import Objectives
from tests.flowcontrol.controllers import controller, tokens_detector
from tests.flowcontrol.test_reserve_rate import Clock, Fleet
from tests.flowcontrol.test_reserve_refill import ended_on, lower_released


def make(fleet: Fleet, clock: Clock, floor: float) -> FlowController:
    return controller(
        fleet,
        [tokens_detector(2000, outputTokens=0)],
        reserve=1,
        reserve_refill_s=0.4,
        reserve_refill_floor=floor,
        clock=clock,
    )


@pytest.mark.parametrize(("floor", "released"), [(0.0, True), (0.7, True), (0.8, False)])
async def test_the_server_keeps_the_floors_share_of_the_reserve(floor: float, released: bool):
    # As test_reserve_refill: reserve 1,000, B's credit 400, 700 free on B, 100 on A. Kept:
    # 600 without a floor, 700 at 0.7: B still has it (the batch request may go to A); at
    # 0.8, 800: no server has it, the batch request waits.
    clock = Clock()
    fleet = Fleet()
    ctl = make(fleet, clock, floor)
    await ended_on(ctl, fleet, clock, "B")
    assert ctl.refill is not None and ctl.refill.credit("B") == 400
    assert await lower_released(ctl, fleet) is released
    assert ctl.refill.last_credit == 400  # the credit itself is unchanged, only what it lends
    assert ctl.reserve.last_held == 1000


def test_the_setting_is_read_and_bounded():
    s = decode_settings({"flow_control": {"reserve_refill_floor": 0.8}})
    assert s.flow_control.reserve_refill_floor == 0.8
    assert FlowControlSettings().reserve_refill_floor == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError):
            decode_settings({"flow_control": {"reserve_refill_floor": bad}})
    with pytest.raises(ValueError):
        make(Fleet(), Clock(), 1.5)


def test_without_the_horizon_it_says_it_does_nothing(caplog):
    doc = {"flow_control": {"admit_per_endpoint": True, "reserve_for_higher_bands": 1,
                            "reserve_refill_floor": 0.8}}  # fmt: skip
    cfg = build_configured_flow_control(decode_settings(doc))
    assert cfg is not None
    with caplog.at_level(logging.WARNING, logger="extproc.flowcontrol"):
        Admission(cfg, lambda: [], objectives=Objectives(table={}))
    assert "reserve_refill_floor has no effect without reserve_refill_s" in caplog.text
