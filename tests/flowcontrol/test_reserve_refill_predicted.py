"""The refill credit from predicted ends (`flow_control.reserve_refill_credit: predicted`,
flowcontrol/refill.py): the tokens of the requests on a server whose start plus output
times the measured per-output-token time falls within the horizon; the ends' rate until
that time is measured."""

from __future__ import annotations

import pytest

from extproc.config import decode_settings
from extproc.errors import ConfigError
from extproc.flowcontrol.admission import Admission
from extproc.flowcontrol.config import build_flow_config
from extproc.flowcontrol.controller import FlowController, FlowRequest
from extproc.flowcontrol.refill import CREDITS, SPEED_TRUSTED, WINDOW_S, PredictedRefill, Refill
from tests.flowcontrol.controllers import controller, tokens_detector
from tests.flowcontrol.test_reserve_rate import Clock, Fleet
from tests.flowcontrol.test_reserve_refill import lower_released


def measured(clock: Clock, horizon_s: float = 0.5) -> PredictedRefill:
    """A credit whose per-token time is measured: 0.1 s per output token (on "C")."""
    r = PredictedRefill(horizon_s, clock)
    for i in range(SPEED_TRUSTED):
        r.placed(("m", i), "C", 100, 10)
        clock.now += 1.0
        r.freed("C", 100, ("m", i))
    assert r.per_token_s() == pytest.approx(0.1)
    return r


def test_unmeasured_the_credit_is_the_ends_rate_and_counted():
    clock = Clock()
    r = PredictedRefill(0.5, clock)
    r.freed("A", 600)
    assert r.per_token_s() is None
    assert r.credit("A") == int(600 / WINDOW_S * 0.5)  # as `rate` credits it
    assert r.unpredicted == 1
    assert CREDITS["rate"] is Refill and CREDITS["predicted"] is PredictedRefill


def test_the_credit_is_the_requests_predicted_to_end_within_the_horizon():
    clock = Clock()
    r = measured(clock)
    r.placed("soon", "A", 700, 20)  # ends 2.0 s after its start
    r.placed("later", "A", 900, 40)  # 4.0 s
    r.placed("no-output", "A", 500, 0)  # nothing to time it by: never credited ahead
    assert r.credit("A") == 0  # nothing due within 0.5 s
    clock.now += 1.6
    assert r.credit("A") == 700
    assert r.rates() == {"A": 700 / 0.5}  # what the peers count
    r.peer_rates = {"A": 200.0}
    assert r.credit("A") == 700 + 100  # plus the peers' prediction over the horizon
    r.peer_rates = {}
    clock.now += 0.5  # "soon" is past its predicted end and still running: late, not counted
    assert r.credit("A") == 0
    clock.now += 1.5
    assert r.credit("A") == 900
    r.freed("A", 900, "later")
    assert r.credit("A") == 0  # ended: its room is free, no longer to come
    assert r.unpredicted == 0


def test_lumpy_ends_the_rate_credits_room_nothing_is_about_to_free():
    # 3,000 tokens ended on A over the last 3 s, so the rate credits 500 within 0.5 s; the
    # request still there ends in 6 s. The prediction credits nothing.
    clock = Clock()
    rate, predicted = Refill(0.5, clock), measured(clock)
    for r in (rate, predicted):
        r.placed("long", "A", 800, 60)
    for _ in range(3):
        for r in (rate, predicted):
            r.freed("A", 1000)
        clock.now += 0.9
    assert rate.credit("A") == 500
    assert predicted.credit("A") == 0


async def on_b(ctl: FlowController, clock: Clock, output: int) -> None:
    """Eight interactive requests of 1,000 tokens ran on B at 0.1 s per output token (the
    reserve is 1,000; the ends' rate on B then credits 400 within 0.4 s), and one of
    `output` tokens is on B now."""
    for _ in range(SPEED_TRUSTED):
        t = await ctl.admit(FlowRequest("t", 10, 1000, 10, output_tokens=10))
        ctl.placed(t, "B")
        clock.now += 1.0
        ctl.release(t)
    t = await ctl.admit(FlowRequest("t", 10, 600, 10, output_tokens=output))
    ctl.placed(t, "B")


def make(fleet: Fleet, clock: Clock, credit: str) -> FlowController:
    return controller(
        fleet,
        [tokens_detector(2000, outputTokens=0)],
        reserve=1,
        reserve_refill_s=0.4,
        reserve_refill_credit=credit,
        clock=clock,
    )


async def test_the_reserve_is_credited_only_what_is_predicted_to_end():
    # B has 700 free, 600 with the lower request on it: short of the 1,000 reserved by 400.
    clock = Clock()
    fleet = Fleet()
    ctl = make(fleet, clock, "predicted")
    await on_b(ctl, clock, output=3)  # ends within 0.3 s: its 597 prompt tokens credited
    # (not its output: the detector, without outputTokens, never counted it)
    assert ctl.refill is not None and ctl.refill.credit("B") == 597
    assert await lower_released(ctl, fleet)
    # One that ends in 5 s: the rate's credit (1,000 x 8 / 3 s over 0.4 s) would let the
    # lower request in; predicted, nothing frees within the horizon, so it waits.
    clock = Clock()
    fleet = Fleet()
    ctl = make(fleet, clock, "predicted")
    await on_b(ctl, clock, output=50)
    assert not await lower_released(ctl, fleet)
    clock = Clock()
    fleet = Fleet()
    rate = make(fleet, clock, "rate")
    await on_b(rate, clock, output=50)
    assert await lower_released(rate, fleet)


def test_the_setting_is_read_and_checked():
    s = decode_settings({"flow_control": {"reserve_refill_credit": "predicted"}})
    assert s.flow_control.reserve_refill_credit == "predicted"
    with pytest.raises(ConfigError):
        decode_settings({"flow_control": {"reserve_refill_credit": "guess"}})


def configured(credit: str) -> Admission:
    """Flow control as configured with `reserve_refill_credit: <credit>` (a 0.3 s horizon,
    a reserve for one higher-band request), as the server assembles it."""
    s = decode_settings(
        {
            "flow_control": {
                "admit_per_endpoint": True,
                "reserve_for_higher_bands": 1,
                "reserve_refill_s": 0.3,
                "reserve_refill_credit": credit,
            }
        }
    ).flow_control
    assert s is not None
    return Admission(
        build_flow_config(None, None, [], s), lambda: (), registry=None, endpoints=list
    )


def collected(flow: Admission, name: str) -> float:
    """The value of `flow`'s metric `name` (one sample)."""
    return {f.name: f for f in flow.collect()}[name].samples[0].value


def test_configured_it_is_the_controllers_credit_and_its_fallback_is_counted():
    flow = configured("predicted")
    refill = flow.controller.refill
    assert isinstance(refill, PredictedRefill) and refill.horizon_s == 0.3
    refill.credit("A")  # no per-token time yet: from the ends' rate, counted
    assert collected(flow, "extproc_flow_reserve_refill_unpredicted") == 1
