"""The reserve for higher bands less the room a server is about to free
(`flow_control.reserve_refill_s`, flowcontrol/refill.py): a server may keep that much less
of the reserve as the requests that ended there recently free per second, times the horizon;
a server where nothing ended keeps the whole reserve."""

from __future__ import annotations

import asyncio

import pytest

from extproc.config import decode_settings
from extproc.errors import ConfigError
from extproc.flowcontrol.controller import FlowController, FlowRequest
from extproc.flowcontrol.refill import WINDOW_S, Refill
from tests.flowcontrol.controllers import controller, settle, tokens_detector
from tests.flowcontrol.test_reserve_rate import Clock, Fleet


def make(fleet: Fleet, clock: Clock, refill_s: float) -> FlowController:
    return controller(
        fleet,
        [tokens_detector(2000, outputTokens=0)],
        reserve=1,
        reserve_refill_s=refill_s,
        clock=clock,
    )


def test_the_credit_is_the_recent_ends_rate_times_the_horizon():
    clock = Clock()
    r = Refill(0.5, clock)
    r.freed("A", 600)
    clock.now += 1.0
    r.freed("A", 600)
    assert r.credit("A") == int(1200 / WINDOW_S * 0.5)
    assert r.credit("B") == 0  # nothing ended there
    clock.now += WINDOW_S - 0.5  # the first end left the window
    assert r.credit("A") == int(600 / WINDOW_S * 0.5)
    clock.now += WINDOW_S
    assert r.credit("A") == 0
    r.freed("", 500)  # never placed: nowhere to count it
    r.freed("B", 0)
    assert r.credit("B") == 0
    with pytest.raises(ValueError):
        Refill(-1.0, clock)


async def ended_on(ctl: FlowController, fleet: Fleet, clock: Clock, address: str) -> None:
    """Three interactive requests of 1,000 tokens ended on `address` over the last second;
    the largest interactive request (the reserve) is 1,000."""
    for _ in range(3):
        t = await ctl.admit(FlowRequest("t", 10, 1000, 10, output_tokens=0))
        ctl.placed(t, address)
        ctl.release(t)
        clock.now += 0.3


async def lower_released(ctl: FlowController, fleet: Fleet) -> bool:
    fleet.tokens.update(A=1900, B=1300)  # A full; B has 700 free: less than the 1,000
    low = asyncio.create_task(ctl.admit(FlowRequest("t", 0, 100, 10)))
    await settle()
    done = low.done()
    low.cancel()
    return done


async def test_a_server_about_to_free_room_keeps_less_of_the_reserve():
    # B freed 3,000 tokens over the last 3 s: 1,000/s, 400 within 0.4 s. It has 700 free;
    # with a 100-token batch request on it, 600: short of the 1,000 reserved, not of 600.
    clock = Clock()
    fleet = Fleet()
    ctl = make(fleet, clock, 0.4)
    await ended_on(ctl, fleet, clock, "B")
    assert ctl.refill is not None and ctl.refill.credit("B") == 400
    assert await lower_released(ctl, fleet)
    assert ctl.refill.last_credit == 400
    assert ctl.reserve.last_held == 1000


async def test_without_the_horizon_or_recent_ends_the_whole_reserve_is_kept():
    clock = Clock()
    fleet = Fleet()
    off = make(fleet, clock, 0.0)
    await ended_on(off, fleet, clock, "B")
    assert off.refill is None
    assert not await lower_released(off, fleet)
    # The ends were on A (full): B, where the reserve is, frees nothing soon.
    clock = Clock()
    fleet = Fleet()
    elsewhere = make(fleet, clock, 0.4)
    await ended_on(elsewhere, fleet, clock, "A")
    assert not await lower_released(elsewhere, fleet)
    # Too long ago: out of the window.
    clock = Clock()
    fleet = Fleet()
    stale = make(fleet, clock, 0.4)
    await ended_on(stale, fleet, clock, "B")
    clock.now += WINDOW_S
    assert not await lower_released(stale, fleet)


async def test_a_request_ending_twice_counts_once():
    clock = Clock()
    fleet = Fleet()
    ctl = make(fleet, clock, 1.0)
    t = await ctl.admit(FlowRequest("t", 10, 600, 10, output_tokens=0))
    ctl.placed(t, "B")
    ctl.release(t, output_held=True)  # its end comes with the access log
    assert ctl.refill is not None and ctl.refill.credit("B") == 0
    ctl.ended(t)
    ctl.ended(t)
    assert ctl.refill.credit("B") == int(600 / WINDOW_S)


def test_the_setting_is_read_and_bounded():
    s = decode_settings({"flow_control": {"reserve_refill_s": 0.3}})
    assert s.flow_control.reserve_refill_s == 0.3
    with pytest.raises(ConfigError):
        decode_settings({"flow_control": {"reserve_refill_s": -1}})
