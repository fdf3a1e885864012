"""The flow controller with a manual clock and a detector the test sets: admission, queueing,
band priority, fairness, bounds, TTL, cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from extproc.core import EndpointState
from extproc.flowcontrol.config import BandSpec, FlowConfig, build_flow_config
from extproc.flowcontrol.controller import (
    EVICTED_PRESSURE,
    REJECTED_SATURATED,
    REJECTED_TTL,
    FlowController,
    FlowRejected,
    FlowRequest,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Slots:
    """A pool of `capacity` request slots: the test's stand-in for the endpoints' load,
    through the real concurrency detector (one endpoint, maxConcurrency = capacity)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def states(self) -> Sequence[EndpointState]:
        return [EndpointState(inflight_requests=self.used)]


def make(
    capacity: int = 1,
    *,
    flow_control: dict | None = None,
    plugins: list | None = None,
    weights: dict | None = None,
    half_life: float = 0.0,
) -> tuple[FlowController, Slots, Clock]:
    slots = Slots(capacity)
    clock = Clock()
    plugins = [
        {"type": "concurrency-detector", "parameters": {"maxConcurrency": capacity}},
        *(plugins or []),
    ]
    fc = {"saturationDetector": {"pluginRef": "concurrency-detector"}, **(flow_control or {})}
    cfg: FlowConfig = build_flow_config(fc, None, plugins)
    ctl = FlowController(
        detector=cfg.detector,
        states=slots.states,
        band=cfg.band,
        ttl_s=cfg.ttl_s,
        max_requests=cfg.max_requests,
        max_bytes=cfg.max_bytes,
        weights=weights,
        usage_half_life_s=half_life,
        usage_limit=cfg.usage_limit,
        priorities=tuple(cfg.bands),
        clock=clock,
    )
    return ctl, slots, clock


def req(flow: str = "a", priority: int = 0, tokens: int = 100, nbytes: int = 10) -> FlowRequest:
    return FlowRequest(flow, priority, tokens, nbytes)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def start(ctl: FlowController, *reqs: FlowRequest) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(ctl.admit(r)) for r in reqs]
    await settle()
    return tasks


def place(ctl: FlowController, slots: Slots, task: asyncio.Task):
    """What the router does after admission: count the request in flight."""
    ticket = task.result()
    slots.used += 1
    ctl.placed(ticket)
    return ticket


def finish(ctl: FlowController, slots: Slots, ticket) -> None:
    slots.used -= 1
    ctl.release(ticket)


async def test_admits_at_once_under_capacity_and_queues_past_it():
    ctl, slots, _ = make(capacity=2)
    a, b, c = await start(ctl, req(), req(), req())
    assert a.done() and b.done() and not c.done()
    assert ctl.count == 1
    ta = place(ctl, slots, a)
    place(ctl, slots, b)
    assert not c.done()  # placed work still fills both slots
    finish(ctl, slots, ta)
    await settle()
    assert c.done() and c.result().waited_s == 0.0  # manual clock did not move
    assert ctl.stats.outcomes[(0, "a", "dispatched")] == 3


async def test_pending_work_counts_before_it_is_placed():
    """Released but not yet placed requests fill capacity: one free slot releases one."""
    ctl, _slots, _ = make(capacity=1)
    tasks = await start(ctl, req(), req(), req())
    assert [t.done() for t in tasks] == [True, False, False]
    ctl.tick()
    await settle()
    assert [t.done() for t in tasks] == [True, False, False]
    ctl.release(tasks[0].result())  # ended before being placed (e.g. no endpoint)
    await settle()
    assert [t.done() for t in tasks] == [True, True, False]


async def test_higher_band_goes_first_and_lower_band_waits():
    ctl, slots, _ = make(capacity=1)
    (first,) = await start(ctl, req())
    t0 = place(ctl, slots, first)
    low, high = await start(ctl, req("a", priority=-1), req("b", priority=5))
    finish(ctl, slots, t0)
    await settle()
    assert high.done() and not low.done()
    finish(ctl, slots, place(ctl, slots, high))
    await settle()
    assert low.done()


async def test_new_request_never_overtakes_a_queued_higher_band():
    ctl, slots, _ = make(capacity=1)
    (first,) = await start(ctl, req())
    place(ctl, slots, first)
    (high,) = await start(ctl, req(priority=3))
    slots.used = 0  # capacity appears without a release (a scrape, a peer's release)
    (low,) = await start(ctl, req(priority=0))
    assert high.done() and not low.done()


async def test_ttl_expiry_answers_ttl_reason():
    ctl, slots, clock = make(capacity=1, flow_control={"defaultRequestTTL": "2s"})
    (a,) = await start(ctl, req())
    place(ctl, slots, a)
    (b,) = await start(ctl, req())
    clock.t += 1.9
    ctl.tick()
    await settle()
    assert not b.done()
    clock.t += 0.2
    ctl.tick()
    await settle()
    with pytest.raises(FlowRejected) as err:
        b.result()
    assert err.value.reason == REJECTED_TTL
    assert ctl.count == 0 and ctl.stats.outcomes[(0, "a", "evicted_ttl")] == 1


async def test_band_bound_rejects_newcomer():
    ctl, slots, _ = make(
        capacity=1, flow_control={"priorityBands": [{"priority": 0, "maxRequests": 2}]}
    )
    (a,) = await start(ctl, req())
    place(ctl, slots, a)
    b, c, d = await start(ctl, req(), req(), req())
    assert not b.done() and not c.done()
    with pytest.raises(FlowRejected) as err:
        d.result()
    assert err.value.reason == REJECTED_SATURATED


async def test_global_bound_displaces_lower_band_newest_first():
    ctl, slots, _ = make(capacity=1, flow_control={"maxRequests": 2})
    (a,) = await start(ctl, req())
    place(ctl, slots, a)
    low1, low2 = await start(ctl, req("x", priority=-1), req("y", priority=-1))
    (high,) = await start(ctl, req("z", priority=1))
    assert not high.done() and not low1.done()
    with pytest.raises(FlowRejected) as err:
        low2.result()
    assert err.value.reason == EVICTED_PRESSURE
    # Full, nothing below the newcomer's band: the newcomer itself is shed.
    (low3,) = await start(ctl, req("x", priority=-1))
    assert low3.exception().reason == REJECTED_SATURATED
    # A higher newcomer displaces the remaining low one; the queue holds high work only.
    (high2,) = await start(ctl, req("z", priority=1))
    assert low1.exception().reason == EVICTED_PRESSURE
    assert not high2.done() and ctl.count == 2
    (high3,) = await start(ctl, req("z", priority=1))
    assert high3.exception().reason == REJECTED_SATURATED


async def test_bytes_bound():
    ctl, slots, _ = make(capacity=1, flow_control={"maxBytes": "1k"})
    (a,) = await start(ctl, req())
    place(ctl, slots, a)
    b, c = await start(ctl, req(nbytes=600), req(nbytes=600))
    assert not b.done()
    assert isinstance(c.exception(), FlowRejected)


async def test_cancelled_waiter_leaves_the_queue_at_once():
    ctl, slots, _ = make(capacity=1)
    (a,) = await start(ctl, req())
    ta = place(ctl, slots, a)
    b, c = await start(ctl, req("b"), req("c"))
    b.cancel()
    await settle()
    assert ctl.count == 1 and ctl.bytes == 10
    assert ctl.stats.outcomes[(0, "b", "cancelled")] == 1
    finish(ctl, slots, ta)
    await settle()
    assert c.done() and c.result().request.fairness_id == "c"


async def test_cancel_between_dispatch_and_resume_gives_capacity_back():
    ctl, slots, _ = make(capacity=1)
    (a,) = await start(ctl, req())
    ta = place(ctl, slots, a)
    (b,) = await start(ctl, req())
    finish(ctl, slots, ta)  # b's future resolved, its task not yet resumed
    b.cancel()
    await settle()
    assert b.cancelled()
    assert ctl.pending_requests == 0


async def test_edf_orders_by_deadline_and_fcfs_by_arrival():
    # EDF in one flow: with one TTL, deadlines follow arrival; the SLO policy uses headers.
    ctl, slots, clock = make(
        capacity=1,
        flow_control={"priorityBands": [{"priority": 0, "orderingPolicyRef": "slo"}]},
        plugins=[{"type": "slo-deadline-ordering-policy", "name": "slo"}],
    )
    (a,) = await start(ctl, req())
    ta = place(ctl, slots, a)
    loose = asyncio.create_task(ctl.admit(FlowRequest("f", 0, 1, 1, slo_ttft_s=5.0)))
    await settle()
    clock.t += 1
    tight = asyncio.create_task(ctl.admit(FlowRequest("f", 0, 1, 1, slo_ttft_s=0.5)))
    await settle()
    finish(ctl, slots, ta)
    await settle()
    assert tight.done() and not loose.done()


async def test_round_robin_alternates_flows():
    ctl, slots, _ = make(
        capacity=1,
        flow_control={"defaultPriorityBand": {"fairnessPolicyRef": "round-robin-fairness-policy"}},
    )
    (a,) = await start(ctl, req())
    t = place(ctl, slots, a)
    tasks = await start(ctl, req("x"), req("x"), req("x"), req("y"), req("y"))
    order = []
    for _ in range(5):
        finish(ctl, slots, t)
        await settle()
        done = [x for x in tasks if x.done() and x not in order]
        assert len(done) == 1
        order.append(done[0])
        t = place(ctl, slots, done[0])
    assert [o.result().request.fairness_id for o in order] == ["x", "y", "x", "y", "x"]


async def test_global_strict_is_fifo_across_flows():
    ctl, slots, _ = make(capacity=1)
    (a,) = await start(ctl, req())
    t = place(ctl, slots, a)
    tasks = await start(ctl, req("x"), req("x"), req("y"))
    seen = []
    for _ in range(3):
        finish(ctl, slots, t)
        await settle()
        nxt = next(x for x in tasks if x.done() and x not in seen)
        seen.append(nxt)
        t = place(ctl, slots, nxt)
    assert [s.result().request.fairness_id for s in seen] == ["x", "x", "y"]


async def test_weighted_token_fairness_follows_weights_in_tokens():
    """Three always-backlogged tenants, weights 3:2:1, requests of different sizes: the
    tokens each is served follow the weights, not the request counts."""
    ctl, slots, _ = make(
        capacity=1,
        flow_control={
            "defaultPriorityBand": {"fairnessPolicyRef": "weighted-token-fairness-policy"}
        },
        weights={"a": 3, "b": 2, "c": 1},
    )
    (first,) = await start(ctl, req())
    t = place(ctl, slots, first)
    ctl.served.clear()
    size = {"a": 100, "b": 400, "c": 50}
    waiting = [asyncio.create_task(ctl.admit(req(f, tokens=size[f]))) for f in "abc" * 40]
    await settle()
    served = {"a": 0, "b": 0, "c": 0}
    for _ in range(60):
        finish(ctl, slots, t)
        await settle()
        nxt = next(x for x in waiting if x.done())
        waiting.remove(nxt)
        f = nxt.result().request.fairness_id
        served[f] += size[f]
        t = place(ctl, slots, nxt)
        # Keep every tenant backlogged.
        waiting.append(asyncio.create_task(ctl.admit(req(f, tokens=size[f]))))
        await settle()
    total = sum(served.values())
    for f, w in {"a": 3, "b": 2, "c": 1}.items():
        assert abs(served[f] / total - w / 6) < 0.1 * (w / 6) + 0.03, served
    for x in waiting:
        x.cancel()
    await settle()


async def test_peer_with_higher_band_holds_local_lower_band():
    ctl, _slots, _ = make(capacity=1)
    ctl.peer_top_band = 5
    (a,) = await start(ctl, req(priority=0))
    assert not a.done()  # another replica queues priority 5: capacity is its to use
    ctl.peer_top_band = None
    ctl.dispatch()
    await settle()
    assert a.done()


def test_band_defaults_follow_llm_d():
    cfg = build_flow_config({}, None, [])
    limits, ordering, fairness = cfg.band(0)
    assert (limits.max_requests, limits.max_bytes) == (5000, 1_000_000_000)
    assert type(ordering).type_name == "fcfs-ordering-policy"
    assert type(fairness).type_name == "global-strict-fairness-policy"
    assert type(cfg.detector).type_name == "utilization-detector"
    assert cfg.ttl_s == 60.0
    neg = build_flow_config({"defaultNegativePriorityBand": {"maxRequests": 7}}, None, [])
    assert neg.band(-1)[0].max_requests == 7 and neg.band(1)[0].max_requests == 5000
    assert isinstance(BandSpec(), BandSpec)


def test_priority_holdback_ceilings():
    from extproc.flowcontrol.policies import PriorityHoldback

    rank = PriorityHoldback(PriorityHoldback.Params(minCeiling=0.4, maxCeiling=0.9))
    assert rank.ceiling(10, (10, 5, -1)) == pytest.approx(0.9)
    assert rank.ceiling(5, (10, 5, -1)) == pytest.approx(0.65)
    assert rank.ceiling(-1, (10, 5, -1)) == pytest.approx(0.4)
    value = PriorityHoldback(PriorityHoldback.Params(minCeiling=0.4, domain="value"))
    assert value.ceiling(5, (10, 0)) == pytest.approx(0.7)


async def test_holdback_keeps_headroom_for_the_higher_band():
    ctl, slots, _ = make(
        capacity=4,
        flow_control={
            "usageLimitPolicyPluginRef": "hold",
            "priorityBands": [{"priority": 10}, {"priority": 0}],
        },
        plugins=[
            {"type": "priority-holdback-policy", "name": "hold", "parameters": {"minCeiling": 0.5}}
        ],
    )
    lows = await start(ctl, *(req("l") for _ in range(4)))
    for t in lows[:2]:
        place(ctl, slots, t)
    assert [t.done() for t in lows] == [True, True, False, False]  # held at 2/4 = 0.5
    highs = await start(ctl, req("h", priority=10), req("h", priority=10))
    assert all(t.done() for t in highs)  # the band above goes on up to 1.0


async def test_full_band_displaces_the_tenant_over_its_share():
    ctl, slots, _ = make(
        capacity=1,
        flow_control={
            "priorityBands": [
                {"priority": 0, "maxRequests": 2, "fairnessPolicyRef": "wtf"},
            ]
        },
        plugins=[{"type": "weighted-token-fairness-policy", "name": "wtf"}],
    )
    (a,) = await start(ctl, req("hog", tokens=1000))
    place(ctl, slots, a)  # hog has been served 1000 tokens
    h1, h2 = await start(ctl, req("hog"), req("hog"))
    (newcomer,) = await start(ctl, req("light"))
    assert not newcomer.done()
    assert h2.exception().reason == EVICTED_PRESSURE and not h1.done()
    # The hog itself cannot displace anyone further over their share: it is shed.
    (h3,) = await start(ctl, req("hog"))
    assert h3.exception().reason == REJECTED_SATURATED


async def test_full_band_keeps_queued_work_of_a_flow_just_served():
    """The queue is shared by weight of queued tokens, not by served usage: a flow just
    served a large request (over its usage share for now) keeps its one queued request when
    a flow that already has work queued sends more; otherwise its queue would be empty when
    the usage-based pick turns to it, and its share would go to the others."""
    ctl, slots, _ = make(
        capacity=1,
        flow_control={
            "priorityBands": [
                {"priority": 0, "maxRequests": 2, "fairnessPolicyRef": "wtf"},
            ]
        },
        plugins=[{"type": "weighted-token-fairness-policy", "name": "wtf"}],
    )
    (first,) = await start(ctl, req("big", tokens=2000))
    place(ctl, slots, first)  # big is far over its usage share now
    big, small = await start(ctl, req("big", tokens=2000), req("small"))
    (more,) = await start(ctl, req("small"))
    assert more.exception().reason == REJECTED_SATURATED
    assert not big.done() and not small.done()


async def test_scraped_detectors_keep_placed_work_pending_until_visible():
    from extproc.flowcontrol.detectors import UtilizationDetector

    clock = Clock()
    waiting = {"n": 0}

    def states():
        return [EndpointState(waiting=waiting["n"], age_s=0.0, is_stale=False)]

    ctl = FlowController(
        detector=UtilizationDetector(UtilizationDetector.Params(queueDepthThreshold=2)),
        states=states,
        band=build_flow_config({}, None, []).band,
        visibility_s=0.1,
        clock=clock,
    )
    tasks = await start(ctl, req(), req(), req())
    assert [t.done() for t in tasks] == [True, True, False]  # 2 pending = threshold
    for t in tasks[:2]:
        ctl.placed(t.result())
    ctl.tick()
    await settle()
    assert not tasks[2].done()  # placed, but no scrape shows them yet
    waiting["n"] = 2  # the scrape now does
    clock.t += 0.1
    ctl.tick()
    await settle()
    assert not tasks[2].done() and ctl.pending_requests == 0
    waiting["n"] = 1
    ctl.tick()
    await settle()
    assert tasks[2].done()
