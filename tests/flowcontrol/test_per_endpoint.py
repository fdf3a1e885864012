"""Per-endpoint admission: a request is released only where one endpoint has room for it
(not by the pool's average), placed there, its pending work counted against that endpoint;
and the reserve a lower band leaves for the largest recent request of a higher band."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from extproc.core import EndpointState
from extproc.flowcontrol.controller import FlowController, FlowRequest
from tests.flowcontrol.controllers import controller, settle, tokens_detector

CAP = 1000  # tokens per endpoint (concurrency-detector, tokens mode)


class Fleet:
    """Two endpoints' in-flight tokens, as the router's counters would show them."""

    def __init__(self, a: int = 0, b: int = 0) -> None:
        self.tokens = {"A": a, "B": b}

    def endpoints(self) -> Sequence[tuple[str, EndpointState]]:
        return [
            (k, EndpointState(inflight_requests=1 if v else 0, inflight_tokens=v))
            for k, v in self.tokens.items()
        ]

    def states(self) -> Sequence[EndpointState]:
        return [s for _, s in self.endpoints()]


def make(fleet: Fleet, *, per_endpoint: bool = True, reserve: int = 0) -> FlowController:
    endpoints = fleet.endpoints if per_endpoint else None
    return controller(fleet, [tokens_detector(CAP)], endpoints=endpoints, reserve=reserve)


def req(tokens: int, priority: int = 0) -> FlowRequest:
    return FlowRequest("t", priority, tokens, 10)


def place(ctl: FlowController, fleet: Fleet, ticket) -> None:
    """What the router does after admission: count the request in flight where it went."""
    fleet.tokens[ticket.target] += ticket.request.tokens
    ctl.placed(ticket)


async def test_released_only_where_it_fits_and_placed_there():
    # The pool is 55% full on average: by the average a 500-token request is admitted.
    fleet = Fleet(a=900, b=200)
    old = make(fleet, per_endpoint=False)
    assert (await old.admit(req(500))).endpoints == frozenset()  # anywhere, even on A
    ctl = make(fleet)
    ticket = await ctl.admit(req(500))
    assert ticket.endpoints == {"B"} and ticket.target == "B"


async def test_held_while_no_endpoint_has_room_then_released_to_the_one_that_frees():
    fleet = Fleet(a=700, b=700)  # 70% on average, 300 free on each
    ctl = make(fleet)
    task = asyncio.create_task(ctl.admit(req(400)))
    await settle()
    assert not task.done() and ctl.no_room >= 1
    # The old rule would have released it (pool under its ceiling).
    assert ctl.saturation() < 1.0
    fleet.tokens["A"] = 100
    ctl.tick()
    await settle()
    assert task.result().endpoints == {"A"}


async def test_an_idle_endpoint_takes_a_request_larger_than_its_ceiling():
    fleet = Fleet()
    ctl = make(fleet)
    ticket = await ctl.admit(req(1500))
    assert ticket.endpoints == {"A", "B"}


async def test_work_released_and_not_placed_counts_on_its_endpoint():
    fleet = Fleet(a=100, b=100)
    ctl = make(fleet)
    first = await ctl.admit(req(600))
    second = await ctl.admit(req(600))  # the first is pending on its target, not placed
    assert {first.target, second.target} == {"A", "B"}
    assert second.endpoints == {second.target}
    third = asyncio.create_task(ctl.admit(req(600)))
    await settle()
    assert not third.done()  # neither endpoint has 600 left once the two are counted
    place(ctl, fleet, first)
    ctl.tick()
    await settle()
    assert not third.done()  # placed: now in the in-flight counts instead
    fleet.tokens[first.target] -= first.request.tokens
    ctl.release(first)  # ended: its endpoint has room again
    await settle()
    assert third.result().endpoints == {first.target}


async def test_lower_band_leaves_room_for_the_largest_recent_higher_request():
    fleet = Fleet()
    ctl = make(fleet, reserve=1)
    high = await ctl.admit(req(500, priority=10))  # seen: interactive work is up to 500
    ctl.release(high)
    fleet.tokens.update(A=700, B=400)
    # On B it would leave neither endpoint room for 500 more; on A, B keeps it.
    first = await ctl.admit(req(300))
    assert first.endpoints == {"A"}
    ctl.release(first)  # (never placed: not counted anywhere any more)
    fleet.tokens.update(A=800, B=600)
    ctl2 = make(fleet, reserve=0)
    assert (await ctl2.admit(req(200))).endpoints == {"A", "B"}  # no reserve: both fit
    low = asyncio.create_task(ctl.admit(req(200)))
    await settle()
    assert not low.done()  # either placement would take the interactive reserve
    assert ctl.reserve_held >= 1 and ctl.reserve_held <= ctl.no_room  # counted as such
    assert ctl2.reserve_held == 0
    hi = await ctl.admit(req(400, priority=10))  # the higher band is not held back
    assert hi.endpoints == {"B"}
    place(ctl, fleet, hi)  # B: 1000
    fleet.tokens.update(A=100)  # A ended work: 200 more there leaves it room for 500
    ctl.tick()
    await settle()
    assert low.done()


async def test_a_reserve_of_two_keeps_room_for_the_two_largest_together():
    fleet = Fleet()
    ctl = make(fleet, reserve=2)
    for size in (300, 200, 100):
        ctl.release(await ctl.admit(req(size, priority=10)))
    fleet.tokens.update(A=900, B=400)
    held = ctl.reserve_held
    low = asyncio.create_task(ctl.admit(req(200)))
    await settle()
    assert not low.done()  # on B: 600 + 500 reserved > 1000; on A it does not fit at all
    assert ctl.reserve_held > held
    fleet.tokens.update(B=300)
    ctl.tick()
    await settle()
    assert low.result().endpoints == {"B"}  # 300 + 200 + 500 = 1000


def test_endpoints_that_cannot_be_judged_never_have_room():
    from extproc.flowcontrol.detectors import ConcurrencyDetector, UtilizationDetector

    util = UtilizationDetector()
    assert util.endpoint_saturation(EndpointState(age_s=None), 1, 10) == float("inf")
    fresh = EndpointState(age_s=0.01, kv_usage=0.4, kv_blocks=100, kv_block_size=10)
    assert util.endpoint_saturation(fresh, 1, 400) == (0.4 + 0.4) / 0.8
    conc = ConcurrencyDetector(
        ConcurrencyDetector.Params(concurrencyMode="tokens", kvCacheFraction=1.0)
    )
    assert conc.endpoint_saturation(EndpointState(), 1, 10) == float("inf")
    sized = EndpointState(inflight_tokens=100, kv_blocks=100, kv_block_size=10)
    assert conc.endpoint_saturation(sized, 1, 400) == 0.5


async def test_a_configured_higher_band_is_reserved_for_before_it_sends_anything():
    # A burst's first seconds: batch alone so far. Reserving only for interactive sizes
    # seen (none), the second batch request took the other server too.
    fleet = Fleet()
    ctl = make(fleet, reserve=1)
    first = await ctl.admit(req(600))
    place(ctl, fleet, first)
    second = asyncio.create_task(ctl.admit(req(600)))
    await settle()
    assert not second.done()  # either server with it leaves no room for 600 more
    hi = await ctl.admit(req(600, priority=10))  # the first interactive finds the room
    assert hi.target != first.target


async def test_the_prior_yields_to_the_higher_bands_own_full_history():
    fleet = Fleet()
    ctl = make(fleet, reserve=1)
    big = await ctl.admit(req(900))  # a large batch request: the prior while young
    ctl.release(big)
    for _ in range(100):  # a full history of small interactive requests
        ctl.release(await ctl.admit(req(100, priority=10)))
    fleet.tokens.update(A=500)
    # Room for 100 more interactive tokens stays on A or B: batch is not held for 900.
    assert (await ctl.admit(req(500))).endpoints == {"A", "B"}
