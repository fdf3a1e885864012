"""A higher band's request waiting for room keeps the server it waits for
(`flow_control.waiting_claims_room`, flowcontrol/claims.py): it is tried before its band's
newer requests, which the band's token fairness would pick first, and they go elsewhere or
wait instead of taking the room that frees where it waits."""

from __future__ import annotations

import asyncio

from extproc.config import decode_settings
from extproc.flowcontrol.controller import FlowController, FlowRequest
from extproc.flowcontrol.policies import FCFSOrdering, WeightedTokenFairness
from extproc.flowcontrol.tickets import BandLimits
from tests.flowcontrol.controllers import controller, settle, tokens_detector
from tests.flowcontrol.test_reserve_rate import Clock, Fleet


def make(fleet: Fleet, claims: bool) -> FlowController:
    """Servers of 2,000 tokens; both bands by weighted token fairness, tenant `c` far over
    its share (its requests are large), so the band picks `a` first whenever both wait."""
    ctl = controller(
        fleet,
        [tokens_detector(2000, outputTokens=0)],
        band=lambda p: (BandLimits(p), FCFSOrdering(), WeightedTokenFairness()),
        clock=Clock(),
        waiting_claims_room=claims,
    )
    ctl.served = {"c": 50_000.0}
    return ctl


async def large_waits_then_small_arrives(ctl: FlowController, fleet: Fleet):
    """`c`'s 800-token interactive request finds no room (A has 500 free, B 300) and waits;
    A frees 200 (700 free), B frees 200 (500 free), and `a`'s 400-token request arrives."""
    fleet.tokens.update(A=1500, B=1700)
    large = asyncio.create_task(ctl.admit(FlowRequest("c", 10, 800, 10)))
    await settle()
    assert not large.done()
    fleet.tokens.update(A=1300, B=1500)
    small = asyncio.create_task(ctl.admit(FlowRequest("a", 10, 400, 10)))
    await settle()
    return large, small


async def test_a_waiting_request_keeps_the_server_it_waits_for():
    fleet = Fleet()
    ctl = make(fleet, claims=True)
    large, small = await large_waits_then_small_arrives(ctl, fleet)
    # `a` went where it does not take `c`'s room: B (A would leave `c` 300 short).
    assert small.done() and small.result().target == "B"
    assert small.result().endpoints == frozenset({"B"})
    assert not large.done()
    assert ctl.claims is not None and ctl.claims.made >= 2
    assert ctl.claims.published() == {"A": 800}
    # A frees 100 more: `c` fits there now (1,200 + 800).
    fleet.tokens["A"] = 1200
    ctl.tick()
    await settle()
    assert large.done() and large.result().target == "A"
    assert ctl.claims.published() == {}


async def test_without_the_setting_the_band_fairness_gives_the_room_away():
    fleet = Fleet()
    ctl = make(fleet, claims=False)
    large, small = await large_waits_then_small_arrives(ctl, fleet)
    assert ctl.claims is None
    # `a` is picked first and goes to the server with the most room: the one `c` waits for.
    assert small.done() and small.result().target == "A"
    fleet.tokens["A"] = 1200
    ctl.tick()
    await settle()
    assert not large.done()  # 1,200 + 400 (a, not yet placed) + 800 > 2,000
    large.cancel()


async def test_a_newer_request_that_fits_beside_the_claim_still_goes_there():
    fleet = Fleet()
    ctl = make(fleet, claims=True)
    fleet.tokens.update(A=1500, B=1900)
    large = asyncio.create_task(ctl.admit(FlowRequest("c", 10, 800, 10)))
    await settle()
    fleet.tokens["A"] = 1250  # 750 free: not enough for c; with c claimed, none for a...
    small = asyncio.create_task(ctl.admit(FlowRequest("a", 10, 400, 10)))
    await settle()
    assert not large.done() and not small.done()  # ... and B has 100 free: a waits too
    fleet.tokens["A"] = 700  # 1,300 free: c and a both fit on A
    ctl.tick()
    await settle()
    assert large.done() and small.done()
    assert large.result().target == "A" and small.result().target == "A"


async def test_the_oldest_waiting_request_goes_first_and_lower_bands_wait():
    fleet = Fleet()
    ctl = make(fleet, claims=True)
    ctl.served["b"] = 40_000.0
    fleet.tokens.update(A=1900, B=1900)
    first = asyncio.create_task(ctl.admit(FlowRequest("c", 10, 600, 10)))
    await settle()
    second = asyncio.create_task(ctl.admit(FlowRequest("b", 10, 600, 10)))
    low = asyncio.create_task(ctl.admit(FlowRequest("a", 0, 50, 10)))
    await settle()
    # Each waiting request claims the server where it comes closest: c one, b the other.
    assert sorted(ctl.claims.published().values()) == [600, 600]  # type: ignore[union-attr]
    fleet.tokens["B"] = 1400  # room for one 600 on B only: the older (c) takes it
    ctl.tick()
    await settle()
    assert first.done() and not second.done() and not low.done()
    fleet.tokens["A"] = 1000
    ctl.tick()
    await settle()
    assert second.done() and second.result().target == "A"
    await settle()
    assert low.done()  # the band above has nothing queued any more


async def test_peers_claims_count_for_their_band_and_below():
    fleet = Fleet()
    ctl = make(fleet, claims=True)
    assert ctl.claims is not None
    fleet.tokens.update(A=1300, B=1500)  # A 700 free, B 500
    # A peer's band-10 request waits for A with 800 tokens.
    ctl.claims.peers_seen([(10, {"A": 800}), (10, {})])
    t = await ctl.admit(FlowRequest("a", 10, 400, 10))
    assert t.target == "B"
    ctl.release(t)
    # A band above the peer's claim does not see it.
    t = await ctl.admit(FlowRequest("a", 20, 400, 10))
    assert t.target == "A"
    ctl.release(t)


def test_the_setting_is_read():
    s = decode_settings({"flow_control": {"waiting_claims_room": True}})
    assert s.flow_control.waiting_claims_room
    assert not decode_settings({"flow_control": {}}).flow_control.waiting_claims_room


async def test_a_waiting_request_does_not_count_the_peers_claims():
    """Two replicas' waiting requests claiming one server must not each wait for room for
    both: a waiting request ignores the peers' claims (a newer one does not)."""
    fleet = Fleet()
    ctl = make(fleet, claims=True)
    assert ctl.claims is not None
    fleet.tokens.update(A=1500, B=1700)  # A 500 free, B 300
    large = asyncio.create_task(ctl.admit(FlowRequest("c", 10, 800, 10)))
    await settle()
    assert not large.done()
    ctl.claims.peers_seen([(10, {"A": 800})])  # a peer's waiting request, also on A
    fleet.tokens["A"] = 1200  # room for one 800 on A
    ctl.tick()
    await settle()
    assert large.done() and large.result().target == "A"
