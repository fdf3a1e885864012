"""Two controllers sharing flow state through a real Redis: strict priority and token usage
hold across replicas; Redis gone -> per-replica flow control, logged and counted."""

from __future__ import annotations

import asyncio
import logging

from msgspec import msgpack
from redis.asyncio import Redis

from extproc.flowcontrol.shared import SharedFlowState
from tests.flowcontrol.test_controller import make, place, req, settle, start
from tests.redis_servers import RedisServer


async def test_replicas_share_top_band_and_served_tokens(redis_server: RedisServer):
    a, slots_a, _ = make(capacity=2)
    # b's pool has room for a's released-but-unplaced request (counted fleet-wide) plus one.
    b, _slots_b, _ = make(capacity=2)
    sa = SharedFlowState.from_url(redis_server.url, a, namespace="t1", process_id="a")
    sb = SharedFlowState.from_url(redis_server.url, b, namespace="t1", process_id="b")
    try:
        (first,) = await start(a, req("x", tokens=500))
        place(a, slots_a, first)
        (_second,) = await start(a, req("x", tokens=200))  # released, not yet placed
        (high,) = await start(a, req("x", priority=7))  # queued at replica a
        await sa.exchange()
        await sb.exchange()
        assert b.peer_top_band == 7 and sb.stats.peers == 1
        assert b.peer_served == {"x": 700.0}
        assert b.peer_pending == (1, 200)  # released at a, not yet visible to a detector
        # Replica b has capacity of its own but a's priority-7 work comes first.
        (low,) = await start(b, req("y", priority=0))
        assert not low.done()
        high.cancel()
        await settle()
        await sa.exchange()
        await sb.exchange()
        await settle()
        assert b.peer_top_band is None and low.done()
    finally:
        await sa.aclose()
        await sb.aclose()


async def test_redis_down_degrades_to_local_and_says_so(redis_server: RedisServer, caplog):
    a, _, _ = make(capacity=1)
    sa = SharedFlowState.from_url(redis_server.url, a, namespace="t2", process_id="a")
    try:
        await sa.exchange()
        assert not sa.degraded and sa.stats.exchanges == 1
        a.peer_top_band = 3  # as if a peer had reported
        a.peer_flows = {0: frozenset({"x"})}
        redis_server.kill()
        with caplog.at_level(logging.WARNING, logger="extproc.flowcontrol"):
            await sa.exchange()
            await sa.exchange()
        assert sa.degraded and sa.stats.errors == 2
        assert a.peer_top_band is None and a.peer_served == {} and a.peer_flows == {}
        assert sum("per replica" in r.getMessage() for r in caplog.records) == 1
        (r,) = await start(a, req())
        assert r.done()  # local flow control goes on
    finally:
        await asyncio.wait_for(sa.aclose(), 5)


async def test_degraded_shared_state_shows_in_metrics(redis_server: RedisServer):
    from prometheus_client import CollectorRegistry

    from extproc.flowcontrol.admission import Admission
    from extproc.flowcontrol.config import build_flow_config
    from extproc.server.families import SHARED_FLOW

    cfg = build_flow_config({}, None, [])
    adm = Admission(cfg, list, registry=CollectorRegistry())
    adm.shared = SharedFlowState.from_url(
        redis_server.url, adm.controller, namespace="t3", process_id="a"
    )

    def gauge(name: str) -> float:
        # The degraded gauge is Admission's; the exchange counters are SharedFlowStats
        # fields, exported through their table.
        assert adm.shared is not None
        found = [*adm.collect(), *SHARED_FLOW.families(adm.shared.stats)]
        fam = next(f for f in found if f.name == name)
        return fam.samples[0].value

    try:
        await adm.shared.exchange()
        assert gauge("extproc_flow_shared_degraded") == 0.0
        redis_server.kill()
        await adm.shared.exchange()
        assert gauge("extproc_flow_shared_degraded") == 1.0
        assert gauge("extproc_flow_shared_errors") == 1.0
    finally:
        await asyncio.wait_for(adm.aclose(), 5)


async def test_a_corrupt_peer_entry_is_counted_on_metrics_and_said_once(
    redis_server: RedisServer, caplog
):
    """An entry the Lua script passes (a msgpack array with a live expiry) that is no
    replica's: skipped at every exchange, counted in extproc_flow_shared_bad_entries, one
    warning line (rate-limited), and not counted as a peer."""
    from extproc.server.families import SHARED_FLOW

    a, _, _ = make(capacity=1)
    sa = SharedFlowState.from_url(redis_server.url, a, namespace="t9", process_id="a")
    raw = Redis.from_url(redis_server.url)
    try:
        await raw.hset("{t9}:flow", "forged", msgpack.encode([2**52, "too short"]))
        with caplog.at_level(logging.WARNING, logger="extproc.flowcontrol"):
            for _ in range(3):
                await sa.exchange()
        fam = next(f for f in SHARED_FLOW.families(sa.stats) if f.name.endswith("bad_entries"))
        assert fam.samples[0].value == 3 and sa.stats.peers == 0 and not sa.degraded
        lines = [r.getMessage() for r in caplog.records if "shared entry skipped" in r.getMessage()]
        assert len(lines) == 1, lines
    finally:
        await raw.aclose()
        await sa.aclose()


async def test_shares_hold_fleet_wide_when_each_tenant_reaches_one_replica(
    redis_server: RedisServer,
):
    """Tenant A (weight 3) reaches only replica a, tenant B (weight 1) only replica b, both
    behind one slot. Each replica alone would fill every free slot with its own tenant;
    sharing which flows are queued where, the replica whose tenant is next fleet-wide takes
    the slot and the other leaves it: 3:1, as with one replica."""
    weights = {"A": 3.0, "B": 1.0}
    band = {"priority": 0, "fairnessPolicyRef": "weighted-token-fairness-policy"}
    fc = {"priorityBands": [band]}
    a, slots, _ = make(capacity=1, weights=weights, flow_control=fc)
    b, _, _ = make(capacity=1, weights=weights, flow_control=fc)
    b._states = slots.states  # one pool: both replicas see the same in-flight count
    sa = SharedFlowState.from_url(redis_server.url, a, namespace="t4", process_id="a")
    sb = SharedFlowState.from_url(redis_server.url, b, namespace="t4", process_id="b")
    try:
        (h,) = await start(a, req("H"))
        running = (a, place(a, slots, h))
        queued = {a: list(await start(a, *(req("A") for _ in range(8)))),
                  b: list(await start(b, *(req("B") for _ in range(8))))}  # fmt: skip
        order: list[str] = []
        for _ in range(8):
            await sa.exchange()
            await sb.exchange()
            ctl, ticket = running
            slots.used -= 1
            ctl.release(ticket)  # the slot frees; its replica dispatches first, then the other
            for c in (ctl, b if ctl is a else a):
                c.dispatch()
                await settle()
                for t in [t for t in queued[c] if t.done()]:
                    queued[c].remove(t)
                    running = (c, place(c, slots, t))
                    order.append(t.result().request.fairness_id)
        assert len(order) == 8  # one request per free slot, never two
        assert order.count("A") == 6 and order.count("B") == 2, order
        assert a.deferrals + b.deferrals > 0
        # ... counted per band (extproc_flow_peer_deferrals_total{priority}): all in band 0.
        assert a.deferrals_by_band.keys() <= {0} and b.deferrals_by_band.keys() <= {0}
        assert sum(a.deferrals_by_band.values()) + sum(b.deferrals_by_band.values()) == (
            a.deferrals + b.deferrals
        )
    finally:
        await sa.aclose()
        await sb.aclose()


async def test_an_idle_replica_is_still_a_peer(redis_server: RedisServer):
    """Nothing queued, nothing served: the entry survives Redis's Lua re-packing (a nil top
    band or an empty map once made peers drop it as corrupt)."""
    a, _, _ = make(capacity=1)
    b, _, _ = make(capacity=1)
    sa = SharedFlowState.from_url(redis_server.url, a, namespace="t5", process_id="a")
    sb = SharedFlowState.from_url(redis_server.url, b, namespace="t5", process_id="b")
    try:
        await sa.exchange()
        await sb.exchange()
        await sa.exchange()
        assert sa.stats.peers == 1 and sb.stats.peers == 1
        assert a.peer_top_band is None and a.peer_served == {} and a.peer_flows == {}
    finally:
        await sa.aclose()
        await sb.aclose()


async def test_the_prefill_gates_fleet_view_travels_and_degrades(redis_server: RedisServer, caplog):
    """Replica a's placement on A reaches replica b's prefill gate through the shared flow
    state with its size and age (Lua's msgpack re-packing included); with Redis gone b
    counts its own placements only, logs it once and its gauge says so."""
    from prometheus_client import CollectorRegistry

    from extproc.flowcontrol.admission import Admission
    from extproc.flowcontrol.config import build_flow_config
    from tests.flowcontrol import test_prefill_gate as pg

    clock = pg.Clock()
    fleet = pg.Fleet(clock)
    a = pg.make(fleet, clock, {"fleetView": True})
    plugins = [
        {"type": "concurrency-detector", "parameters": {"concurrencyMode": "tokens"}},
        {"type": "prefill-gate", "parameters": {"fleetView": True}},
    ]
    fc = {"saturationDetector": {"pluginRef": "concurrency-detector"}}
    adm = Admission(build_flow_config(fc, None, plugins), list, registry=CollectorRegistry())
    b = adm.controller
    assert a.gate is not None and b.gate is not None
    sa = SharedFlowState.from_url(redis_server.url, a, namespace="t6", process_id="a")
    adm.shared = sb = SharedFlowState.from_url(redis_server.url, b, namespace="t6", process_id="b")

    def gauge(name: str) -> list[tuple[dict, float]]:
        fam = [f for f in adm.collect() if f.name == name]
        return [(s.labels, s.value) for f in fam for s in f.samples]

    b.gate.use_clock(lambda: clock.now)  # (Admission's controller runs on the real clock)
    try:
        pg.place(a, fleet, await a.admit(pg.req(900)), "A")
        clock.now += 0.25
        await sa.exchange()
        await sb.exchange()
        assert b.gate._peers["A"][0][1] == 900
        assert gauge("extproc_flow_prefill_gate_fleet_view") == [({}, 1.0)]
        assert gauge("extproc_flow_prefill_gate_peer_placements") == [({"endpoint": "A"}, 1.0)]
        # b judges A with the engine's one unfinished request: a's, at its own size.
        fleet.scrape(A=1)
        state = dict(fleet.endpoints())["A"]
        assert b.gate.unfinished("A", state) == 900
        redis_server.kill()
        with caplog.at_level(logging.WARNING, logger="extproc.flowcontrol"):
            await sb.exchange()
            await sb.exchange()
        assert gauge("extproc_flow_prefill_gate_fleet_view") == [({}, 0.0)]
        assert b.gate.peer_counts() == {}
        assert sum("placements are unknown" in r.getMessage() for r in caplog.records) == 1
    finally:
        await asyncio.wait_for(sa.aclose(), 5)
        await asyncio.wait_for(adm.aclose(), 5)


async def test_the_room_peers_free_counts_toward_the_reserve_and_degrades(
    redis_server: RedisServer,
):
    """With `reserve_refill_s`, replica a's ends on B reach replica b as a rate of room
    freed there (Lua's msgpack re-packing included): b's credit on B is a's plus its own.
    With Redis gone b forgets a's rate and counts its own ends only."""
    from extproc.flowcontrol.controller import FlowRequest
    from extproc.flowcontrol.refill import WINDOW_S
    from tests.flowcontrol.test_reserve_rate import Clock, Fleet
    from tests.flowcontrol.test_reserve_refill import make as refill_make

    clock = Clock()
    a = refill_make(Fleet(), clock, 1.0)
    b = refill_make(Fleet(), clock, 1.0)
    # b without the setting publishes and reads no rates (an older or plain replica).
    c = refill_make(Fleet(), clock, 0.0)
    sa = SharedFlowState.from_url(redis_server.url, a, namespace="t7", process_id="a")
    sb = SharedFlowState.from_url(redis_server.url, b, namespace="t7", process_id="b")
    sc = SharedFlowState.from_url(redis_server.url, c, namespace="t7", process_id="c")
    try:
        t = await a.admit(FlowRequest("t", 0, 900, 10))
        a.placed(t, "B")
        a.release(t)
        t = await b.admit(FlowRequest("t", 0, 300, 10))
        b.placed(t, "B")
        b.release(t)
        for s in (sa, sb, sc, sa, sb):  # each reads the others' last entries
            await s.exchange()
        assert a.refill is not None and b.refill is not None and c.refill is None
        assert b.refill.peer_rates == {"B": 900 / WINDOW_S}
        assert b.refill.credit("B") == int((900 + 300) / WINDOW_S)
        assert a.refill.credit("B") == int((900 + 300) / WINDOW_S)
        assert b.refill.credit("A") == 0
        # A forged entry (a rate no server frees, or not a number): its rates are dropped,
        # they must not credit the reserve away.
        raw = Redis.from_url(redis_server.url)
        far = 2**52
        for bad in (1e30, float("inf"), float("nan"), -5.0, "x"):
            forged = msgpack.encode([far, False, {}, 0, 0, {}, {}, {"B": bad}])
            await raw.hset("{t7}:flow", "forged", forged)
            await sb.exchange()
            assert b.refill.peer_rates == {"B": 900 / WINDOW_S}, bad
        await raw.hdel("{t7}:flow", "forged")
        await raw.aclose()
        redis_server.kill()
        await sb.exchange()
        assert sb.degraded and b.refill.peer_rates == {}
        assert b.refill.credit("B") == int(300 / WINDOW_S)
    finally:
        for s in (sa, sb, sc):
            await s.aclose()


async def test_waiting_requests_claims_reach_the_peers_and_degrade(redis_server: RedisServer):
    """With `waiting_claims_room`, replica a's interactive request waiting for server A
    reaches replica b as a claim (Lua's msgpack re-packing included): b's newer interactive
    request goes to B, not into the room a's waits for. A forged claim is dropped; with
    Redis gone b forgets a's claims."""
    from extproc.flowcontrol.controller import FlowRequest
    from tests.flowcontrol.test_claims import make as claims_make
    from tests.flowcontrol.test_reserve_rate import Fleet

    fleet = Fleet()
    a, b = claims_make(fleet, claims=True), claims_make(fleet, claims=True)
    assert a.claims is not None and b.claims is not None
    sa = SharedFlowState.from_url(redis_server.url, a, namespace="t8", process_id="a")
    sb = SharedFlowState.from_url(redis_server.url, b, namespace="t8", process_id="b")
    try:
        fleet.tokens.update(A=1300, B=1500)  # A 700 free, B 500
        large = asyncio.create_task(a.admit(FlowRequest("c", 10, 800, 10)))
        await asyncio.sleep(0)
        assert not large.done() and a.claims.published() == {"A": 800}
        for s in (sa, sb):
            await s.exchange()
        assert b.claims.peers == [(10, {"A": 800})]
        t = await b.admit(FlowRequest("a", 10, 400, 10))
        assert t.target == "B"
        b.release(t)
        raw = Redis.from_url(redis_server.url)
        for bad in (-5, 0, 2**40, "x", float("inf"), float("nan"), 1.5, True):
            forged = msgpack.encode([2**52, 10, {}, 0, 0, {}, {}, {}, {"B": bad}])
            await raw.hset("{t8}:flow", "forged", forged)
            await sb.exchange()
            assert b.claims.peers == [(10, {"A": 800})], bad
        await raw.hdel("{t8}:flow", "forged")
        await raw.aclose()
        redis_server.kill()
        await sb.exchange()
        assert sb.degraded and b.claims.peers == []
        large.cancel()
    finally:
        for s in (sa, sb):
            await s.aclose()
