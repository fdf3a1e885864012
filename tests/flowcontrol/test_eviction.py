"""In-flight eviction (`enableEviction`) in the controller, with a manual clock: who is cut
(sheddable only, lowest priority then newest), how many per decision, and the
stop-and-wait pacing (the next decision only after the cut ones ended plus the grace)."""

from __future__ import annotations

import pytest

from extproc.errors import ConfigError
from extproc.flowcontrol.config import build_flow_config
from extproc.flowcontrol.controller import FlowController
from extproc.flowcontrol.eviction import (
    PriorityThenTimeEvictionOrder,
    SheddableEvictionFilter,
)
from tests.flowcontrol.test_controller import Clock, Slots, finish, place, req, settle, start


def make(capacity: int, *, plugins: list | None = None, enable: bool = True):
    slots = Slots(capacity)
    clock = Clock()
    plugins = [
        {"type": "concurrency-detector", "parameters": {"maxConcurrency": capacity}},
        *(plugins or []),
    ]
    fc = {"saturationDetector": {"pluginRef": "concurrency-detector"}, "enableEviction": enable}
    cfg = build_flow_config(fc, None, plugins)
    ctl = FlowController(
        detector=cfg.detector,
        states=slots.states,
        band=cfg.band,
        ttl_s=cfg.ttl_s,
        eviction=cfg.eviction,
        clock=clock,
    )
    return ctl, slots, clock, cfg


def test_config_accepts_llmd_and_gie_names_and_derives_the_grace():
    _, _, _, cfg = make(2)
    ev = cfg.eviction
    assert ev is not None
    assert isinstance(ev.filter, SheddableEvictionFilter)
    assert isinstance(ev.order, PriorityThenTimeEvictionOrder)
    assert ev.max_per_decision == 2 and ev.grace_s < 0.1  # in-flight counts: a few ticks
    gie = [{"type": "eviction-sheddable-filter"}, {"type": "eviction-priority-then-time-ordering"}]
    assert make(2, plugins=gie)[3].eviction is not None
    assert make(2, enable=False)[3].eviction is None
    scraped = build_flow_config({"enableEviction": True}, None, [])
    assert scraped.eviction is not None and scraped.eviction.grace_s >= 0.5  # scrape + staleness
    with pytest.raises(ConfigError):
        bad = {"type": "sheddable-eviction-filter", "parameters": {"x": 1}}
        build_flow_config(None, None, [bad])


async def test_blocked_high_band_cuts_the_newest_sheddable_request_only():
    ctl, slots, clock, _ = make(3)
    cut: list[str] = []
    old, normal, new = await start(ctl, req("old", -1), req("normal", 0), req("new", -1))
    tickets = [place(ctl, slots, t) for t in (old, normal, new)]
    for t in tickets:
        t.on_evict(lambda t=t: cut.append(t.request.fairness_id))
    assert [t.evictable for t in tickets] == [True, False, True]
    clock.t += 1
    (high,) = await start(ctl, req("high", 5))
    assert not high.done()
    assert cut == ["new"]  # lowest priority, then most recently dispatched
    assert ctl.stats.outcomes[(-1, "new", "evicted_inflight")] == 1
    # Stop-and-wait: nothing more is cut while the evicted request's stream is still open.
    clock.t += 5
    ctl.tick()
    assert cut == ["new"]
    finish(ctl, slots, tickets[2])  # its stream ended with the 429
    await settle()
    assert high.done()  # the freed slot went to the high band


async def test_a_request_evicted_before_its_stream_listens_learns_it_at_once():
    ctl, slots, _clock, _ = make(1)
    (low,) = await start(ctl, req("low", -1))
    ticket = low.result()  # not placed, no listener yet: the stream registers after routing
    slots.used += 1
    (high,) = await start(ctl, req("high", 0))
    assert ticket.evicted and not high.done()
    seen: list[bool] = []
    ticket.on_evict(lambda: seen.append(True))
    assert seen == [True]
    finish(ctl, slots, ticket)
    await settle()
    assert high.done()


async def test_pacing_waits_the_grace_after_confirmation_and_sizes_by_the_deficit():
    ctl, slots, clock, cfg = make(2)
    assert cfg.eviction is not None
    lows = await start(ctl, *(req(f"l{i}", -2 + i % 2) for i in range(2)))
    tickets = [place(ctl, slots, t) for t in lows]
    # Over capacity (as after a scrape lag): saturation 3/2 against ceiling 1 -> deficit 0.5,
    # credit 1.5 / 2 running = 0.75 -> one eviction per decision.
    slots.used += 1
    (h1,) = await start(ctl, req("h1", 3))
    assert [t.evicted for t in tickets] == [True, False]  # priority -2 before -1
    finish(ctl, slots, tickets[0])
    await settle()
    assert not h1.done()  # still at capacity (the extra slot)
    ctl.tick()
    assert not tickets[1].evicted  # within the grace after the confirmation
    clock.t += cfg.eviction.grace_s
    ctl.tick()
    assert tickets[1].evicted
    finish(ctl, slots, tickets[1])
    await settle()
    assert h1.done()


async def test_an_unconfirmed_eviction_stops_blocking_after_the_timeout():
    ctl, slots, clock, cfg = make(2)
    assert cfg.eviction is not None
    lows = await start(ctl, req("a", -1), req("b", -1))
    tickets = [place(ctl, slots, t) for t in lows]
    await start(ctl, req("h", 1))
    assert [t.evicted for t in tickets] == [False, True]
    clock.t += cfg.eviction.confirm_timeout_s
    ctl.tick()  # treated as confirmed now; the grace runs from here
    assert not tickets[0].evicted
    clock.t += cfg.eviction.grace_s
    ctl.tick()
    assert tickets[0].evicted


async def test_nothing_at_or_above_the_waiting_band_is_cut():
    ctl, slots, _clock, _ = make(1)
    (a,) = await start(ctl, req("a", -1))
    ta = place(ctl, slots, a)
    (b,) = await start(ctl, req("b", -1))  # same band: waits, cuts nothing
    assert not ta.evicted and not b.done()


async def test_a_request_released_cuttable_stays_a_candidate_until_its_stream_ends():
    """The generated Envoy config with response trailers sent: the request's accounting ends
    at its response headers (`release`), its stream (and the chance to cut it) at the
    response's end (`stream_ended`)."""
    ctl, slots, clock, cfg = make(1)
    assert cfg.eviction is not None
    (low,) = await start(ctl, req("low", -1))
    ticket = place(ctl, slots, low)
    ctl.release(ticket, output_held=True, cuttable=True)  # response headers; in flight still
    assert ctl.evictor is not None and ctl.evictor.running == 1
    (high,) = await start(ctl, req("high", 1))
    assert ticket.evicted and not high.done()  # cut mid-response
    ctl.tick()
    assert not ctl.evictor.gate_open()  # not confirmed until its stream ends
    ctl.stream_ended(ticket)
    assert ctl.evictor.running == 0
    clock.t += cfg.eviction.grace_s
    assert ctl.evictor.gate_open()
    slots.used -= 1  # the proxy's access log: the request is over on its server
    ctl.ended(ticket)
    ctl.tick()
    await settle()
    assert high.done()


async def test_a_request_released_uncuttable_is_no_candidate_any_more():
    ctl, slots, _clock, _ = make(1)
    (low,) = await start(ctl, req("low", -1))
    ticket = place(ctl, slots, low)
    ctl.release(ticket, output_held=True)  # the stream ended at the response headers
    (high,) = await start(ctl, req("high", 1))
    assert not ticket.evicted and not high.done()  # waits for the request's end


async def test_an_evictable_request_running_on_past_its_stream_is_counted_uncuttable():
    ctl, slots, clock, _ = make(2)
    a, b = await start(ctl, req("a", -1), req("b", -1))
    ta, tb = place(ctl, slots, a), place(ctl, slots, b)
    # `a`'s stream ends at its response headers, its request 10 s later (the access log).
    ctl.release(ta, output_held=True, cuttable=True)
    ctl.stream_ended(ta)
    clock.t += 10
    ctl.ended(ta)
    # `b`'s stream lasts to its response's end (`--response-trailers send`).
    ctl.release(tb, output_held=True, cuttable=True)
    clock.t += 10
    ctl.stream_ended(tb)
    clock.t += 0.02  # the access log's flush
    ctl.ended(tb)
    assert ctl.uncuttable == 1
