"""The reserve for a higher band from a configured prior (`flow_control.reserve_prior`):
its expected largest request and arrival rate size the room kept before the band has a
history of its own, so a freshly started picker keeps room from the first request; once
the band has `HISTORY` requests the measured history alone sizes it. Which one is in use
is logged at each change and exported."""

from __future__ import annotations

import asyncio
import logging

import pytest
import yaml

from extproc.config import decode_settings
from extproc.errors import ConfigError
from extproc.flowcontrol.controller import FlowRequest
from extproc.flowcontrol.reserve import HISTORY, BandPrior, Reserve
from tests.flowcontrol.test_reserve_rate import Clock, Fleet, make, settle


def test_the_prior_sizes_the_reserve_before_any_history():
    clock = Clock()
    r = Reserve(1, clock, {10: BandPrior(tokens=2000, prompt=1800, rate=1000.0)})
    # Nothing seen at all: 2000 + 1000 tokens/s x 1800 / 3600 tokens/s = 2500.
    assert r.held(0, (10, 0), 3600.0) == (2500, 10)
    assert r.on_prior == {10: True}
    # Without a prefill speed: the request alone (the rate is left out, and counted).
    assert r.held(0, (10, 0), None) == (2000, 10)
    assert r.rate_unsized == 1
    # Nothing above the top band; the room a lower band keeps is still what is exported.
    assert r.held(10, (10, 0), 3600.0) == (0, 10)
    assert r.last_held == 2000


def test_the_larger_of_prior_and_history_counts_until_the_history_is_full(caplog):
    caplog.set_level(logging.INFO, "extproc.flowcontrol")
    clock = Clock()
    r = Reserve(1, clock, {10: BandPrior(tokens=600, prompt=500, rate=0.0)})
    r.note(10, 900, 100)  # larger than the prior: the history's request counts
    assert r.held(0, (10, 0), None)[0] == 900
    assert "sized from its reserve_prior" in caplog.text
    # Small requests, 1 s apart: the history alone would keep 300; the prior keeps 600.
    r = Reserve(1, clock, {10: BandPrior(tokens=600, prompt=500, rate=0.0)})
    for _ in range(HISTORY - 1):
        clock.now += 1.0
        r.note(10, 300, 100)
    assert r.held(0, (10, 0), None)[0] == 600
    assert r.history(10) == HISTORY - 1 and r.on_prior[10]
    clock.now += 1.0
    r.note(10, 300, 100)
    # Full: measured alone (300 + 300 tokens/s x 200 prompt / 1000 tokens/s = 360).
    assert r.held(0, (10, 0), 1000.0)[0] == 360
    assert r.on_prior[10] is False
    assert "now sized from measured history alone (100 requests)" in caplog.text


def test_without_a_prior_a_short_history_is_said_once(caplog):
    r = Reserve(1, Clock())
    r.note(0, 700, 100)
    assert r.held(0, (10, 0), None)[0] == 700  # the largest of any band
    r.held(0, (10, 0), None)
    assert caplog.text.count("band 10 has no reserve_prior") == 1
    assert r.on_prior == {}


async def test_a_fresh_controller_holds_lower_work_for_the_prior():
    # Cap 2000 per endpoint; A holds a batch request of 800. Batch requests of 300 seen so
    # far: without a prior the reserve is 300 and the next batch request goes anywhere.
    fleet = Fleet(tps=None, A=800)
    ctl = make(fleet, cap=2000, output=0, reserve=1)
    t = await ctl.admit(FlowRequest("t", 0, 300, 10))
    assert t.endpoints == {"A", "B"}
    ctl.release(t)
    # With a prior of 1800-token interactive requests: B must stay free for one (300 +
    # 1800 > 2000), so the batch request may go only to A, whose own room is gone then.
    ctl = make(fleet, cap=2000, output=0, reserve=1)
    ctl.reserve = Reserve(1, Clock(), {10: BandPrior(tokens=1800, prompt=1700)})
    t = await ctl.admit(FlowRequest("t", 0, 300, 10))
    assert t.endpoints == {"A"}
    ctl.release(t)
    # With neither endpoint able to keep 1800 free, the next one is held.
    fleet.tokens["A"] = 1100
    fleet.tokens["B"] = 600
    held = asyncio.create_task(ctl.admit(FlowRequest("t", 0, 300, 10)))
    await settle()
    assert not held.done()
    held.cancel()


def test_the_prior_is_read_from_the_flow_control_section():
    cfg = decode_settings(
        yaml.safe_load(
            "flow_control:\n"
            "  admit_per_endpoint: true\n"
            "  reserve_for_higher_bands: 1\n"
            "  reserve_prior:\n"
            "    10: {request_tokens: 2700, tokens_per_s: 1400}\n"
        )
    )
    assert cfg.flow_control is not None
    prior = cfg.flow_control.reserve_prior[10]
    assert (prior.request_tokens, prior.tokens_per_s) == (2700, 1400.0)
    with pytest.raises(ConfigError, match="request_tokens"):
        decode_settings({"flow_control": {"reserve_prior": {10: {"request_tokens": 0}}}})


def test_the_priors_prefill_time_prices_the_rate_until_a_speed_is_measured():
    # A fresh picker at a burst's start has no prefill speed yet: with the prior's
    # prefill_s the rate term is 1000 tokens/s x 0.4 s, not left out.
    clock = Clock()
    r = Reserve(1, clock, {10: BandPrior(tokens=2000, prompt=1800, rate=1000.0, prefill_s=0.4)})
    assert r.held(0, (10, 0), None) == (2400, 10)
    assert r.rate_unsized == 0
    # A measured speed prices it as before: 1000 x 1800 / 3600.
    assert r.held(0, (10, 0), 3600.0) == (2500, 10)
    # Once the band's own history is full, the prior no longer counts at all.
    for _ in range(HISTORY):
        clock.now += 1.0
        r.note(10, 500, 100)
    assert r.held(0, (10, 0), None)[0] == 500
    assert r.rate_unsized == 1
    s = decode_settings(
        {"flow_control": {"reserve_prior": {10: {"request_tokens": 2000, "prefill_s": 0.4}}}}
    )
    assert s.flow_control.reserve_prior[10].prefill_s == 0.4
