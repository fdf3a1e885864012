"""Per-endpoint eviction (`flow_control.evict_per_endpoint`) in the controller, against a
hand-made two-endpoint fleet and a manual clock: a waiting interactive request gets the
newest batch requests cut on the endpoint where it comes closest to fitting, just enough of
them, paced by the stop-and-wait; never a request of its own band, nothing when the lower
band there cannot make the room (counted), and llm-d's sheddable filter still cuts no
priority-0 request."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from extproc.core import EndpointState
from extproc.errors import ConfigError
from extproc.flowcontrol.config import FlowControlSettings, build_flow_config
from extproc.flowcontrol.controller import FlowController, FlowRequest, Ticket
from extproc.flowcontrol.eviction import (
    EvictionSettings,
    LowerBandEvictionFilter,
    SheddableEvictionFilter,
)
from tests.flowcontrol.controllers import controller, settle, tokens_detector
from tests.flowcontrol.test_controller import Clock

CAP = 1000  # tokens per endpoint


class Fleet:
    def __init__(self) -> None:
        self.tokens = {"A": 0, "B": 0}
        self.reqs = {"A": 0, "B": 0}

    def endpoints(self) -> Sequence[tuple[str, EndpointState]]:
        return [
            (k, EndpointState(inflight_requests=self.reqs[k], inflight_tokens=v))
            for k, v in self.tokens.items()
        ]

    def states(self) -> Sequence[EndpointState]:
        return [s for _, s in self.endpoints()]


def make(
    *,
    filt: SheddableEvictionFilter | LowerBandEvictionFilter | None = None,
    per_endpoint: bool = True,
) -> tuple[FlowController, Fleet, Clock]:
    fleet, clock = Fleet(), Clock()
    settings = EvictionSettings(filter=filt or LowerBandEvictionFilter())
    ctl = controller(
        fleet,
        [tokens_detector(CAP)],
        eviction=settings,
        evict_per_endpoint=per_endpoint,
        clock=clock,
    )
    return ctl, fleet, clock


def place(ctl: FlowController, fleet: Fleet, ticket: Ticket) -> Ticket:
    """What the router does: count it in flight where it was released to."""
    fleet.tokens[ticket.target] += ticket.request.tokens
    fleet.reqs[ticket.target] += 1
    ctl.placed(ticket, ticket.target)
    return ticket


def finish(ctl: FlowController, fleet: Fleet, ticket: Ticket) -> None:
    fleet.tokens[ticket.endpoint] -= ticket.request.tokens
    fleet.reqs[ticket.endpoint] -= 1
    ctl.release(ticket)


def req(name: str, tokens: int, priority: int = 0) -> FlowRequest:
    return FlowRequest(name, priority, tokens, 10)


async def fill(ctl: FlowController, fleet: Fleet, clock: Clock, *reqs: FlowRequest) -> list[Ticket]:
    """Admit and place each in turn (a second apart: dispatch order is age order)."""
    out = []
    for r in reqs:
        clock.t += 1
        out.append(place(ctl, fleet, await ctl.admit(r)))
    return out


def watch(tickets: list[Ticket]) -> list[str]:
    cut: list[str] = []
    for t in tickets:
        t.on_evict(lambda t=t: cut.append(t.request.fairness_id))
    return cut


async def test_a_waiting_interactive_request_cuts_the_newest_batch_there_just_enough():
    ctl, fleet, clock = make()
    batch = await fill(ctl, fleet, clock, *(req(f"b{i}", 300) for i in range(6)))
    assert [t.endpoint for t in batch] == ["A", "B"] * 3  # 900 on each, 100 free
    assert all(t.evictable for t in batch)
    cut = watch(batch)
    hi = asyncio.create_task(ctl.admit(req("hi", 400, priority=10)))
    await settle()
    assert not hi.done()
    # A and B are alike; on A (the closer by name), the newest batch request there: one
    # cut of 300 leaves 100 + 300 >= 400, so only one.
    assert cut == ["b4"]
    assert ctl.evict_outcomes == {"cut": 1, "short": 0}
    assert ctl.stats.outcomes[(0, "b4", "evicted_inflight")] == 1
    # Stop-and-wait: nothing more is cut while the cut one's stream is open, even for more.
    more = asyncio.create_task(ctl.admit(req("hi2", 400, priority=10)))
    clock.t += 5
    ctl.tick()
    await settle()
    assert cut == ["b4"] and not more.done()
    finish(ctl, fleet, batch[4])  # its stream ended with the cut
    await settle()
    assert hi.done() and hi.result().target == "A"  # served where the room was made
    place(ctl, fleet, hi.result())
    # The next decision, after the grace, for the second waiting request: on B now (A has
    # 0 free, B 100), its newest batch request.
    clock.t += 1
    ctl.tick()
    await settle()
    assert cut == ["b4", "b5"]
    more.cancel()


async def test_never_its_own_band_and_nothing_when_the_lower_band_there_cannot_make_room():
    ctl, fleet, clock = make()
    (hi_a,) = await fill(ctl, fleet, clock, req("hiA", 800, priority=10))
    (hi_b,) = await fill(ctl, fleet, clock, req("hiB", 800, priority=10))
    batch = await fill(ctl, fleet, clock, req("bA", 100), req("bB", 100))
    assert [t.endpoint for t in batch] == ["A", "B"]
    assert not hi_a.evictable and not hi_b.evictable
    cut = watch([hi_a, hi_b, *batch])
    hi = asyncio.create_task(ctl.admit(req("hi", 400, priority=10)))
    await settle()
    # 100 free on A; its one batch request frees 100 more: short of 400, so none is cut.
    assert cut == [] and not hi.done()
    assert ctl.evict_outcomes == {"cut": 0, "short": 1}
    hi.cancel()
    # The lowest band waiting for room never cuts anything (nothing ranks below it).
    lo = asyncio.create_task(ctl.admit(req("lo", 400)))
    await settle()
    assert cut == [] and not lo.done()
    lo.cancel()


async def test_where_the_closest_server_cannot_make_room_the_next_closest_does():
    ctl, fleet, clock = make()
    held = await fill(
        ctl, fleet, clock,
        req("hiA", 750, priority=10), req("hiB", 300, priority=10),
        req("bB1", 300), req("bB2", 300), req("bA", 100),
    )  # fmt: skip
    assert [t.endpoint for t in held] == ["A", "B", "B", "B", "A"]  # A 850, B 900
    cut = watch(held)
    hi = asyncio.create_task(ctl.admit(req("hi", 300, priority=10)))
    await settle()
    # Closest on A (1150 against 1200), where batch holds 100: not enough; on B the newest
    # batch request's 300 is.
    assert cut == ["bB2"] and ctl.evict_outcomes == {"cut": 1, "short": 0}
    finish(ctl, fleet, held[3])
    await settle()
    assert hi.result().target == "B"


async def test_the_pool_at_the_ceiling_also_makes_room_on_one_endpoint():
    ctl, fleet, clock = make()
    batch = await fill(ctl, fleet, clock, *(req(f"b{i}", 500) for i in range(4)))
    cut = watch(batch)  # both endpoints at 1000: the pool at its ceiling
    assert ctl.saturation() >= 1.0
    hi = asyncio.create_task(ctl.admit(req("hi", 200, priority=10)))
    await settle()
    assert cut == ["b2"]  # A's newest: 500 - 200 fits A and the pool drops under 1.0
    finish(ctl, fleet, batch[2])
    await settle()
    assert hi.result().target == "A"


async def test_llm_d_filter_never_cuts_priority_zero_and_the_switch_is_off_by_default():
    ctl, fleet, clock = make(filt=SheddableEvictionFilter())
    batch = await fill(ctl, fleet, clock, *(req(f"b{i}", 450) for i in range(4)))
    assert not any(t.evictable for t in batch)
    hi = asyncio.create_task(ctl.admit(req("hi", 400, priority=10)))
    await settle()
    assert not hi.done() and ctl.evict_outcomes == {"cut": 0, "short": 1}  # nothing to cut
    hi.cancel()
    # enableEviction without evict_per_endpoint: llm-d's pool-wide rule, which sizes by
    # saturation units (one request here, the newest anywhere: B's).
    ctl, fleet, clock = make(per_endpoint=False)
    batch = await fill(ctl, fleet, clock, *(req(f"b{i}", 450) for i in range(4)))
    cut = watch(batch)
    hi = asyncio.create_task(ctl.admit(req("hi", 400, priority=10)))
    await settle()
    assert cut == ["b3"] and ctl.evict_outcomes["cut"] == 0
    hi.cancel()


async def test_outcomes_count_waiting_requests_not_dispatch_opportunities():
    ctl, fleet, clock = make()
    fleet.tokens["B"], fleet.reqs["B"] = CAP, 1  # full with work this picker did not place
    held = await fill(
        ctl, fleet, clock, req("hi1", 200, priority=10), req("hi2", 400, priority=10), req("b", 300)
    )
    assert [t.endpoint for t in held] == ["A"] * 3  # A 900
    cut = watch(held)
    hi = asyncio.create_task(ctl.admit(req("hi", 450, priority=10)))
    await settle()
    # On A, cutting the batch request leaves 1050: nothing to cut anywhere, counted once
    # however many opportunities it waits through (one a tick).
    for _ in range(20):
        clock.t += 0.02
        ctl.tick()
        await settle()
    assert cut == [] and not hi.done()
    assert ctl.evict_outcomes == {"cut": 0, "short": 1}
    # hi1 ends: A 700; cutting the batch request now makes its room (850). The same
    # request, stuck before, counts a cut too.
    finish(ctl, fleet, held[0])
    await settle()
    assert cut == ["b"] and ctl.evict_outcomes == {"cut": 1, "short": 1}
    clock.t += 1
    ctl.tick()
    await settle()
    assert ctl.evict_outcomes == {"cut": 1, "short": 1}  # the gate closed: nothing more
    finish(ctl, fleet, held[2])
    await settle()
    assert place(ctl, fleet, hi.result()).endpoint == "A"
    # A second request stuck the same way is a second one.
    hi2 = asyncio.create_task(ctl.admit(req("hi3", 450, priority=10)))
    for _ in range(5):
        clock.t += 0.02
        ctl.tick()
        await settle()
    assert not hi2.done() and ctl.evict_outcomes == {"cut": 1, "short": 2}
    hi2.cancel()


def test_config_names_the_filter_and_the_settings_validate():
    det = tokens_detector(CAP)
    fc = {"saturationDetector": {"pluginRef": "concurrency-detector"}, "enableEviction": True}
    cfg = build_flow_config(fc, None, [det, {"type": "lower-band-eviction-filter"}])
    assert cfg.eviction is not None and isinstance(cfg.eviction.filter, LowerBandEvictionFilter)
    assert LowerBandEvictionFilter().accept(0, 10) and not LowerBandEvictionFilter().accept(10, 10)
    assert not LowerBandEvictionFilter().accept(0, None)
    with pytest.raises(ConfigError):
        bad = {"type": "lower-band-eviction-filter", "parameters": {"x": 1}}
        build_flow_config(fc, None, [det, bad])
    import msgspec

    s = msgspec.convert({"evict_per_endpoint": True}, FlowControlSettings)
    assert s.evict_per_endpoint
    assert FlowControlSettings().evict_per_endpoint is False
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"evict_margin": 0.05}, FlowControlSettings)  # measured, removed


async def test_a_cut_request_is_taken_back_out_of_its_flows_served_tokens():
    """Fairness counts served tokens: a cut request's client got no answer, so its charge at
    dispatch goes (what is left of it after the decay), and its flow is not pushed behind
    its weight by the cut. The other flows keep theirs."""
    ctl, fleet, clock = make()
    batch = await fill(ctl, fleet, clock, *(req(f"b{i}", 300) for i in range(6)))
    assert ctl.served == {f"b{i}": 300 for i in range(6)}  # each request's tokens, charged
    clock.t += 30  # a usage half-life and more: the charges weigh less than half now
    ctl.tick()
    decayed = ctl.served["b0"]
    assert 100 < decayed < 150
    cut = watch(batch)
    hi = asyncio.create_task(ctl.admit(req("hi", 400, priority=10)))
    await settle()
    assert cut == ["b4"]
    assert "b4" not in ctl.served  # its charge, decayed as it was, taken back entirely
    assert ctl.served == {f"b{i}": decayed for i in (0, 1, 2, 3, 5)}
    hi.cancel()


async def test_a_cut_request_is_taken_back_out_of_its_programs_attained_service():
    """`program-aware-fairness` charges a request's cost at dispatch: a cut one's comes back
    out, decayed with the policy's own half-life (not `usage_half_life_s`), so a program
    whose requests are cut is not served last for service it never got."""
    fleet, clock = Fleet(), Clock()
    policy = {"type": "program-aware-fairness", "parameters": {"lasHalfLifeSeconds": 10}}
    cfg = build_flow_config(
        {"saturationDetector": {"pluginRef": "concurrency-detector"},
         "defaultPriorityBand": {"fairnessPolicyRef": "program-aware-fairness"}},
        None,
        [tokens_detector(CAP), policy],
    )  # fmt: skip
    ctl = controller(
        fleet,
        [tokens_detector(CAP)],
        band=cfg.band,
        eviction=EvictionSettings(filter=LowerBandEvictionFilter()),
        evict_per_endpoint=True,
        clock=clock,
    )
    # Each 300 tokens, 10 of them output: a service of 290 + 2 x 10, dispatched a second
    # apart.
    batch = await fill(
        ctl, fleet, clock, *(FlowRequest(f"b{i}", 0, 300, 10, output_tokens=10) for i in range(6))
    )
    assert ctl.program_service() == pytest.approx(
        {f"b{i}": 310 * 2 ** ((i - 5) / 10) for i in range(6)}
    )
    clock.t += 20  # two of the policy's half-lives (under one of usage_half_life_s)
    before = ctl.program_service()
    assert before["b5"] == pytest.approx(310 / 4)
    cut = watch(batch)
    hi = asyncio.create_task(ctl.admit(req("hi", 350, priority=10)))  # one cut on A
    await settle()
    assert cut == ["b4"]
    after = ctl.program_service()
    assert after.pop("b4") == 0.0  # its charge, decayed as the policy decays it, taken back
    kept = {f: v for f, v in before.items() if f != "b4"}
    assert after == pytest.approx({**kept, "hi": 0.0})  # (hi: seen by the pick, not served)
    hi.cancel()


async def ticks(ctl: FlowController, clock: Clock, n: int = 1) -> None:
    """`n` dispatch opportunities, 20 ms apart (the default tick)."""
    for _ in range(n):
        clock.t += 0.02
        ctl.tick()
        await settle()


async def queue_two(
    ctl: FlowController, clock: Clock, first: FlowRequest, second: FlowRequest
) -> tuple[asyncio.Task[Ticket], asyncio.Task[Ticket]]:
    """Two requests queued in this order, then five dispatch opportunities."""
    one = asyncio.create_task(ctl.admit(first))
    await settle()
    two = asyncio.create_task(ctl.admit(second))
    await settle()
    await ticks(ctl, clock, 5)
    return one, two


async def test_only_the_head_is_offered_a_cut_the_band_leaves_in_order():
    """Without `waiting_claims_room` a band's requests leave in the order its policies pick
    them, and only the request picked (the head) is offered eviction. By design: room made
    for a request behind a head that fits nowhere would sit unused (the head blocks the band,
    and strict priority keeps the lower bands off it), the cut request's work lost for
    nothing; and when the head gets a cut, the stop-and-wait gate closes on the one decision,
    so the next request gets its own offer only once it is the head."""
    ctl, fleet, clock = make()
    held = await fill(
        ctl, fleet, clock,
        req("hiA", 800, priority=10), req("hiB", 600, priority=10), req("bB", 300), req("bA", 100),
    )  # fmt: skip
    assert [t.endpoint for t in held] == ["A", "B", "B", "A"]  # 900 on each
    cut = watch(held)
    h1, h2 = await queue_two(ctl, clock, req("h1", 500, priority=10), req("h2", 300, priority=10))
    # h1 fits nowhere even with every batch request cut (A 1300, B 1100): short. h2 would
    # fit B with bB cut (900), but is not offered a cut: nothing cut, nothing counted for it.
    assert cut == [] and not h1.done() and not h2.done()
    assert ctl.evict_outcomes == {"cut": 0, "short": 1}
    # The room a cut of bB would have made, made by its end instead: h2 still waits behind
    # h1, which still fits nowhere (B 1100), so that cut would have bought nothing.
    finish(ctl, fleet, held[2])
    await ticks(ctl, clock)
    assert not h1.done() and not h2.done()
    finish(ctl, fleet, held[0])  # hiA ends: h1 goes (on A), then h2, in order
    await settle()
    assert place(ctl, fleet, h1.result()).endpoint == "A"
    place(ctl, fleet, h2.result())
    assert cut == [] and ctl.evict_outcomes == {"cut": 0, "short": 1}


async def test_a_second_waiting_request_gets_its_cut_as_the_head_after_the_first_decision():
    """Two waiting interactive requests, each needing a cut, on different servers: the
    head's decision closes the gate, the second is neither cut for nor counted `short`
    meanwhile; once the head is served it is the head, and gets its own cut. Each request
    counts one outcome."""
    ctl, fleet, clock = make()
    batch = await fill(ctl, fleet, clock, *(req(f"b{i}", 300) for i in range(6)))
    cut = watch(batch)  # A: b0 b2 b4, B: b1 b3 b5; 900 on each
    h1, h2 = await queue_two(ctl, clock, req("h1", 400, priority=10), req("h2", 400, priority=10))
    assert cut == ["b4"] and not h2.done()
    assert ctl.evict_outcomes == {"cut": 1, "short": 0}
    finish(ctl, fleet, batch[4])  # the cut one's stream ends
    await settle()
    assert place(ctl, fleet, h1.result()).endpoint == "A"
    clock.t += 1  # past the grace: h2, the head now, closest on B
    ctl.tick()
    await settle()
    assert cut == ["b4", "b5"] and ctl.evict_outcomes == {"cut": 2, "short": 0}
    finish(ctl, fleet, batch[5])
    await settle()
    assert place(ctl, fleet, h2.result()).endpoint == "B"
