"""Predicted-TTFT placement on crafted candidates: stickiness breaks exactly when waiting on
the sticky endpoint costs more than recomputing elsewhere, with no hand-set weight."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.core import Decision
from extproc.endpoints.peer_arrivals import PeerArrivals
from extproc.scheduling.plugins.prefix import NoHitLRUScorer
from extproc.scheduling.plugins.ttft import PredictedTTFTScorer
from tests.scheduling.helpers import cand, req


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


# The in-flight floor the default had before the fifteenth session: each in-flight request's
# uncached prompt counted until it ends. The tests of that floor (and of the peers' share of
# it, `peerInflight`) ask for it by name.
UNTIL_END = PredictedTTFTScorer.Params(inflight_floor="untilEnd", spill_cost="ignore")
# The tests of the prediction's terms compare the candidates' predictions as they are:
# `spillCost: fleetBusy` (the default since the twenty-fourth session) would add to each
# candidate holding less of the prompt than another a charge whenever some candidate has a
# queue, which most of these set up. They ask for none; the spill tests ask for it.
NO_SPILL = PredictedTTFTScorer.Params(spill_cost="ignore")


def place(scorer: PredictedTTFTScorer, r, cands, addr: str) -> None:
    chosen = next(c for c in cands if c.endpoint.address == addr)
    scorer.observe(r, cands, Decision(endpoints=(chosen.endpoint,)))


def test_sticks_while_the_wait_is_shorter_than_recomputing_then_breaks():
    clock = Clock()
    sc = PredictedTTFTScorer(NO_SPILL, clock=clock)
    r = req(blocks=100, tokens=6400)  # 6,400 prompt tokens
    # a holds 90% of the prompt; b and c nothing. Speeds measured at 6,400 tok/s.
    cands = [
        cand("a", prefix=90, prefill_tps=6400.0),
        cand("b", prefill_tps=6400.0),
        cand("c", prefill_tps=6400.0),
    ]
    s = sc.score(r, cands)
    assert s[0] == 1.0 and s[1] < 0.2  # 0.1 s on a vs 1.0 s elsewhere
    # Queue 0.8 s of prefill work on a: still better than recomputing 1.0 s elsewhere.
    place(sc, req(blocks=100, tokens=5120), [cand("a", prefill_tps=6400.0)], "a")
    s = sc.score(r, cands)
    assert s[0] == 1.0
    # Another 0.2 s: waiting (1.0 s) + 0.1 s now exceeds recomputing (1.0 s): break.
    place(sc, req(blocks=100, tokens=1280), [cand("a", prefill_tps=6400.0)], "a")
    s = sc.score(r, cands)
    assert s[0] < 1.0 and s[1] == s[2] == 1.0
    # The queue drains in real time: after 1 s, a wins again.
    clock.t += 1.0
    assert sc.score(r, cands)[0] == 1.0


def test_measured_speed_decides_between_unequal_servers():
    sc = PredictedTTFTScorer(clock=Clock())
    r = req(blocks=10, tokens=10_000)
    slow_hit = cand("slow", prefix=5, prefill_tps=1000.0)  # 5,000 tokens left at 1k/s: 5 s
    fast_cold = cand("fast", prefill_tps=20_000.0)  # 10,000 tokens at 20k/s: 0.5 s
    s = sc.score(r, [slow_hit, fast_cold])
    assert s[1] == 1.0 and s[0] < 0.2


def test_scraped_waiting_requests_count_for_other_replicas_placements():
    sc = PredictedTTFTScorer(NO_SPILL, clock=Clock())
    for _ in range(40):  # learn a mean placed prefill of ~6,400 tokens
        place(sc, req(blocks=100, tokens=6400), [cand("z", prefill_tps=1e9)], "z")
    r = req(blocks=100, tokens=6400)
    a = cand("a", prefix=100, prefill_tps=6400.0, waiting=3)  # ~3 x 0.87 s queued
    b = cand("b", prefill_tps=6400.0)  # 1 s to recompute
    s = sc.score(r, [a, b])
    assert s[1] == 1.0 and s[0] < 0.5


def test_endpoint_mean_waiting_floor_counts_a_holders_queued_hits_as_hits():
    # The fleet's placements average ~6,400 uncached tokens (cold prompts); the holder's
    # in-flight requests are hits: 3 of them, 600 uncached tokens in all.
    def scorer(floor: str) -> PredictedTTFTScorer:
        sc = PredictedTTFTScorer(
            PredictedTTFTScorer.Params(waiting_floor=floor, spill_cost="ignore"), clock=Clock()
        )
        for _ in range(40):
            place(sc, req(blocks=100, tokens=6400), [cand("z", prefill_tps=1e9)], "z")
        return sc

    r = req(blocks=100, tokens=6400)
    holder = cand(
        "a", prefix=95, prefill_tps=6400.0, waiting=3, inflight_requests=3, inflight_tokens=600
    )
    cold = cand("b", prefill_tps=6400.0)  # 1 s to compute the whole prompt
    # Default: 3 x ~6,400 tokens queued (~3 s) on the holder: the request leaves it.
    assert scorer("fleetMean").score(r, [holder, cold])[0] < 0.5
    # Its own in-flight mean, 200 tokens each: ~0.1 s queued, +0.05 s: it stays.
    assert scorer("endpointMean").score(r, [holder, cold]) == [1.0, pytest.approx(0.155, abs=0.01)]
    # Without in-flight requests there (placed behind the pickers' back) the fleet's mean.
    unknown = cand("a", prefix=95, prefill_tps=6400.0, waiting=3)
    assert scorer("endpointMean").score(r, [unknown, cold])[0] < 0.5
    # More waiting than in flight (a peer's placements not exchanged yet): the excess at the
    # fleet's mean: 200 + 2 x ~6,400 tokens, ~2 s.
    lagging = cand(
        "a", prefix=95, prefill_tps=6400.0, waiting=3, inflight_requests=1, inflight_tokens=200
    )
    (t, _) = scorer("endpointMean").explain(r, [lagging, cold])
    assert t["waiting_floor_s"] == pytest.approx((200 + 2 * 6400) / 6400, rel=0.01)


def test_a_shared_first_block_does_not_make_a_request_warm():
    lru = NoHitLRUScorer()
    r = req(blocks=40, tokens=2560)
    # Every server holds the shared header block (1 of 40): this request is new.
    cands = [cand(a, prefix=1) for a in ("a", "b", "c", "d")]
    lru.observe(r, cands, Decision(endpoints=(cands[0].endpoint,)))
    lru.observe(r, cands, Decision(endpoints=(cands[1].endpoint,)))
    s = lru.score(r, cands)
    assert s[0] < s[2] and s[1] < s[2]  # spread away from the recent cold picks
    # One server holds more than the others: that is this request's own prefix.
    warm = [cand("a", prefix=30), *(cand(x, prefix=1) for x in ("b", "c", "d"))]
    assert lru.score(r, warm) == [1.0] * 4


def test_on_two_servers_the_one_holding_the_prefix_makes_the_request_warm():
    lru = NoHitLRUScorer()
    r = req(blocks=40, tokens=2560)
    cold = [cand("a"), cand("b")]
    lru.observe(r, cold, Decision(endpoints=(cold[1].endpoint,)))  # b took the last new one
    assert lru.score(r, cold) == [1.0, 0.0]
    # a holds this request's prefix: one holder of two is not "most", so no LRU pull to b.
    warm = [cand("a", prefix=30), cand("b")]
    assert lru.score(r, warm) == [1.0, 1.0]
    lru.observe(r, warm, Decision(endpoints=(warm[0].endpoint,)))
    assert lru.score(r, cold) == [1.0, 0.0]  # a warm pick does not count as a cold one
    # Both hold the same shared header: still new, and spread.
    header = [cand("a", prefix=1), cand("b", prefix=1)]
    assert lru.score(r, header) == [1.0, 0.0]


def test_bounded_load_spills_a_hot_prefix_group_to_a_second_server():
    from extproc.scheduling.plugins.ttft import BoundedLoadFilter

    f = BoundedLoadFilter()
    r = req(blocks=10, tokens=640)
    # At low load the holder keeps it: 1 in flight against an idle fleet is within bound.
    low = [cand("a", prefix=10, inflight_requests=1), cand("b"), cand("c")]
    assert [c.endpoint.address for c in f.filter(r, low)] == ["a", "b", "c"]
    # The group has piled 4 requests onto a: mean (4+1)/3 x 1.25 + 1 = 3.1, a is out.
    hot = [cand("a", prefix=10, inflight_requests=4), cand("b"), cand("c")]
    assert [c.endpoint.address for c in f.filter(r, hot)] == ["b", "c"]
    # Everyone equally busy: nobody is removed.
    busy = [cand(x, inflight_requests=5) for x in ("a", "b", "c")]
    assert len(f.filter(r, busy)) == 3


def test_other_replicas_inflight_prefill_counts_as_a_queue():
    sc = PredictedTTFTScorer(UNTIL_END, clock=Clock())
    r = req(blocks=10, tokens=6400)
    # Nothing this replica placed on a, but 12,800 tokens of prefill other replicas placed.
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=12_800)  # 2 s queued
    b = cand("b", prefill_tps=6400.0)  # 1 s to recompute
    s = sc.score(r, [a, b])
    assert s[1] == 1.0 and s[0] < 0.6


def test_with_the_fleets_placements_folded_the_inflight_floor_is_not_taken():
    # The in-flight tokens count requests until they end (decoding ones too); a queue that
    # folds every replica's placements already holds the prefill still ahead.
    sc = PredictedTTFTScorer(UNTIL_END, clock=Clock())
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=12_800)
    b = cand("b", prefill_tps=6400.0)
    folded = [True]
    sc.fleet_folded = lambda: folded[0]
    s = sc.score(r, [a, b])
    assert s[0] == 1.0 and s[1] < 0.2  # the holder, cached and with nothing queued, wins
    # Sharing fails: the floor is back (its own queue sees only its share).
    folded[0] = False
    s = sc.score(r, [a, b])
    assert s[1] == 1.0 and s[0] < 0.6


def test_a_change_of_token_estimates_rescales_the_mean_queued_prefill():
    # Calibration made every estimate 4x larger (and the measured speeds with them): the
    # queue of 3 scraped waiting requests must cost the same time before and after.
    sc = PredictedTTFTScorer(clock=Clock())
    for _ in range(40):
        place(sc, req(blocks=100, tokens=1600), [cand("z", prefill_tps=1e9)], "z")
    r = req(blocks=100, tokens=1600)
    before = sc.predict(r, cand("a", prefix=100, prefill_tps=1600.0, waiting=3), 100.0)
    sc.units_changed(4.0)
    r4 = req(blocks=100, tokens=6400)
    after = sc.predict(r4, cand("a", prefix=100, prefill_tps=6400.0, waiting=3), 100.0)
    assert after > 0.5 and abs(after - before) < 1e-6


def _fill(sc: PredictedTTFTScorer, clock: Clock, *, reused_blocks: int, **state) -> None:
    """40 placements of 6,400-token prompts alternating on a and b, `reused_blocks` of 100
    cached each time; then the queues drain."""
    for i in range(40):
        addr = "ab"[i % 2]
        c = cand(addr, prefix=reused_blocks, prefill_tps=6400.0, **state)
        place(sc, req(blocks=100, tokens=6400), [c], addr)
    clock.t += 3600.0


def test_a_full_cache_makes_leaving_the_holder_cost_the_evictions_it_causes():
    # Both caches hold 6,400 tokens and have been written many times over; half of every
    # placed prompt was cached (the workload reuses). The request's holder a has half its
    # prompt (0.5 s left to compute) and 0.6 s of queue: moving to idle b is faster now
    # (1.0 s against 1.1 s), but writes 3,200 more tokens into b's full cache, evicting
    # prefixes someone will recompute. Predicted TTFT alone moved it; the choice now stays.
    full = {"kv_blocks": 400, "kv_block_size": 16}
    clock = Clock()
    sc = PredictedTTFTScorer(clock=clock)
    _fill(sc, clock, reused_blocks=50, **full)
    place(sc, req(blocks=100, tokens=3840), [cand("a", prefill_tps=6400.0, **full)], "a")
    r = req(blocks=100, tokens=6400)
    a = cand("a", prefix=50, prefill_tps=6400.0, **full)
    b = cand("b", prefill_tps=6400.0, **full)
    assert sc.predict(r, a, clock.t) > sc.predict(r, b, clock.t)  # b is faster now
    s = sc.score(r, [a, b])
    assert s[0] == 1.0 and s[1] < 1.0
    # A longer queue still moves it: the wait beats both recomputes.
    place(sc, req(blocks=100, tokens=6400), [a], "a")
    s = sc.score(r, [a, b])
    assert s[1] == 1.0 and s[0] < 1.0


def test_no_eviction_cost_while_caches_have_room_or_nothing_is_reused():
    r = req(blocks=100, tokens=6400)
    for state, reused in (
        ({"kv_blocks": 1_000_000, "kv_block_size": 16}, 50),  # caches far from full
        ({}, 50),  # capacity unknown
        ({"kv_blocks": 400, "kv_block_size": 16}, 0),  # full, but no prompt was ever reused
    ):
        clock = Clock()
        sc = PredictedTTFTScorer(NO_SPILL, clock=clock)
        _fill(sc, clock, reused_blocks=reused, **state)
        place(sc, req(blocks=100, tokens=3840), [cand("a", prefill_tps=6400.0, **state)], "a")
        a = cand("a", prefix=50, prefill_tps=6400.0, **state)
        b = cand("b", prefill_tps=6400.0, **state)
        assert sc.eviction_cost(r, a) == sc.eviction_cost(r, b) == 0.0
        s = sc.score(r, [a, b])
        assert s[1] == 1.0 and s[0] < 1.0, state  # predicted TTFT alone: b is faster


_FULL = {"kv_blocks": 400, "kv_block_size": 16}


def _full_caches_and_a_prompt_queued_on_b():
    """A scorer whose caches are full (eviction charged on "b"), then one prompt queued on
    "b": the scorer, its clock, a request to score and "b"."""
    clock = Clock()
    sc = PredictedTTFTScorer(clock=clock)
    _fill(sc, clock, reused_blocks=50, **_FULL)
    r = req(blocks=100, tokens=6400)
    b = cand("b", prefill_tps=6400.0, **_FULL)
    assert sc.eviction_cost(r, b) > 0
    place(sc, req(blocks=100, tokens=6400), [b], "b")
    return sc, clock, r, b


def test_a_restarted_endpoint_is_charged_no_evictions_until_it_fills_again():
    # A restarted server starts with an empty cache: what was written to the old process
    # must not make the new one look full (nor its old queue look busy).
    sc, clock, r, b = _full_caches_and_a_prompt_queued_on_b()
    sc.endpoint_reset("b")
    assert sc.eviction_cost(r, b) == 0.0
    assert sc.predict(r, b, clock.t) == sc.predict(r, cand("c", prefill_tps=6400.0), clock.t)
    assert sc.eviction_cost(r, cand("a", prefill_tps=6400.0, **_FULL)) > 0  # a is untouched


def _router_with_full_caches():
    """A router on the default scheduler whose predicted-TTFT scorer has written 20 prompts
    each on "a" and "b" (both past their KV capacity), and a request to score."""
    from extproc.core import Endpoint
    from extproc.endpoints.pool import EndpointPool
    from extproc.router import Router
    from extproc.scheduling.config import build_scheduler, default_config
    from extproc.testing import plugin_registry

    router = Router(
        pool=EndpointPool([Endpoint("a"), Endpoint("b")]),
        scheduler=build_scheduler(default_config(), plugin_registry()),
        parser=lambda *_: None,  # type: ignore[arg-type,return-value]
    )
    (sc,) = [p for p in router.scheduler.plugins if isinstance(p, PredictedTTFTScorer)]
    for i in range(40):
        addr = "ab"[i % 2]
        place(sc, req(blocks=100, tokens=6400), [cand(addr, prefix=50, **_FULL)], addr)
    r = req(blocks=100, tokens=6400)
    return router, sc, r


async def test_the_router_resets_the_scorer_when_an_endpoint_is_forgotten():
    # The assembled server calls `forget_endpoint` when the scraper sees a restart or an
    # outage that empties the cache (server/assembly.py): the scorer must hear of it.
    router, sc, r = _router_with_full_caches()
    assert sc.eviction_cost(r, cand("b", **_FULL)) > 0
    await router.forget_endpoint("b")
    assert sc.eviction_cost(r, cand("b", **_FULL)) == 0.0
    assert sc.eviction_cost(r, cand("a", **_FULL)) > 0


def test_a_cleared_cache_is_charged_no_evictions_and_keeps_its_queue():
    # An engine that emptied its prefix cache (precise mode: AllBlocksCleared) and kept
    # running: nothing written there counts any more, but the prefill queued there is real.
    sc, clock, r, b = _full_caches_and_a_prompt_queued_on_b()
    queued = sc.predict(r, b, clock.t)
    assert sc.eviction_cost(r, b) > 0
    sc.cache_cleared("b")
    assert sc.eviction_cost(r, b) == 0.0
    assert (
        sc.predict(r, b, clock.t) == queued > sc.predict(r, cand("c", prefill_tps=6400.0), clock.t)
    )
    assert sc.eviction_cost(r, cand("a", prefill_tps=6400.0, **_FULL)) > 0  # a is untouched


async def test_the_router_tells_the_scorer_of_a_cleared_cache():
    # The assembled server hands `cache_cleared` to the KV-event subscriber
    # (server/assembly.py), which calls it on AllBlocksCleared.
    router, sc, r = _router_with_full_caches()
    assert sc.eviction_cost(r, cand("b", **_FULL)) > 0
    router.cache_cleared("b")
    assert sc.eviction_cost(r, cand("b", **_FULL)) == 0.0
    assert sc.eviction_cost(r, cand("a", **_FULL)) > 0


FIRST_TOKEN = PredictedTTFTScorer.Params(inflight_floor="untilFirstToken", spill_cost="ignore")


def test_inflight_requests_past_their_first_token_are_not_counted_as_queued_prefill():
    # The holder has 4 requests of 3,200 uncached tokens in flight, all decoding long
    # answers: the engine reports none before its first token. Counted whole (the old
    # floor) they were 2 s of prefill and the next turn left for b.
    sc = PredictedTTFTScorer(FIRST_TOKEN, clock=Clock())
    r = req(blocks=10, tokens=6400)
    b = cand("b", prefill_tps=6400.0)  # 1 s to recompute
    busy = dict(prefill_tps=6400.0, inflight_requests=4, inflight_tokens=12_800, running=4)
    s = sc.score(r, [cand("a", prefix=10, prefilling=0, **busy), b])
    assert s[0] == 1.0 and s[1] < 0.2
    assert sc.floor_fallbacks == 0
    # 3 of the 4 still before their first token: 3 x 3,200 tokens = 1.5 s queued there.
    s = sc.score(r, [cand("a", prefix=10, prefilling=3, waiting=0, **busy), b])
    assert s[1] == 1.0 and 0.6 < s[0] < 0.7
    # Other clients' prefills on the engine count only up to ours (waiting has its floor).
    s = sc.score(r, [cand("a", prefix=10, prefilling=9, **busy), b])
    assert s[1] == 1.0 and s[0] < 0.6
    # `untilEnd` counts each in-flight request until it ends, whatever the engine says.
    sc = PredictedTTFTScorer(UNTIL_END, clock=Clock())
    s = sc.score(r, [cand("a", prefix=10, prefilling=0, **busy), b])
    assert s[1] == 1.0 and s[0] < 0.6
    assert sc.floor_fallbacks == 0


def test_without_the_engines_first_token_count_the_floor_counts_every_request(caplog):
    sc = PredictedTTFTScorer(FIRST_TOKEN, clock=Clock())
    r = req(blocks=10, tokens=6400)
    b = cand("b", prefill_tps=6400.0)
    busy = dict(prefill_tps=6400.0, inflight_requests=4, inflight_tokens=12_800, running=4)
    with caplog.at_level("WARNING", logger="extproc.scheduling.plugins.ttft"):
        # Not exported, then exported but stale: the whole in-flight count, as before.
        s = sc.score(r, [cand("a", prefix=10, **busy), b])
        assert s[1] == 1.0 and s[0] < 0.6
        s = sc.score(r, [cand("a", prefix=10, prefilling=0, age_s=1.0, **busy), b])
        assert s[1] == 1.0 and s[0] < 0.6
    assert sc.floor_fallbacks == 2
    # One line per endpoint, not per prediction.
    lines = [m for m in caplog.messages if "in-flight requests count as prefill" in m]
    assert len(lines) == 1 and "a" in lines[0]


class Peers:
    """The peers' in-flight tokens on "a": `total`, of which `ahead` not yet computed."""

    def __init__(self, total: int, ahead: float) -> None:
        self.totals, self.ahead = {"a": total}, ahead
        self.asked: list[tuple[str, float, float]] = []

    def total(self, address: str) -> int:
        return self.totals.get(address, 0)

    def pending(self, address: str, now: float, tps: float) -> float:
        self.asked.append((address, now, tps))
        return min(self.ahead, self.total(address))

    def pending_shared(self, address: str, now: float, tps: float) -> float:
        raise AssertionError("only peerInflight: sharedLane asks for the shared lane")

    def placed(self, address: str) -> float:
        return 0.0  # nothing written past the caches' room here (`writtenPlacements`)


def peer_scorer(mode: str, clock: Clock) -> PredictedTTFTScorer:
    # `peerInflight` shapes the in-flight floor, which `inflightFloor: drained` (the default)
    # does not take: asked for with the floor counted until the requests end.
    params = PredictedTTFTScorer.Params(
        peer_inflight=mode, inflight_floor="untilEnd", spill_cost="ignore"
    )
    return PredictedTTFTScorer(params, clock=clock)


def test_drained_peers_inflight_keeps_the_holder_once_their_prefill_is_done():
    # 12,800 tokens the other replicas placed on a are still in flight (decoding, or in the
    # gateway): counted whole they are 2 s of queue, more than recomputing on b (1 s).
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=12_800)
    b = cand("b", prefill_tps=6400.0)
    clock = Clock()
    whole = peer_scorer("whole", clock)
    whole.peer_arrivals = Peers(12_800, 0.0)
    s = whole.score(r, [a, b])
    assert s[1] == 1.0 and s[0] < 0.6  # whole: moved, the default before issue 14's tenth session
    drained = peer_scorer("drained", clock)
    peers = Peers(12_800, 0.0)
    drained.peer_arrivals = peers
    s = drained.score(r, [a, b])
    assert s[0] == 1.0 and s[1] < 0.2  # a lane would have computed it: the holder keeps it
    assert peers.asked[0] == ("a", clock.t, 6400.0)
    assert drained.peer_tokens_drained == 12_800
    # What the lane cannot have done yet still counts: 9,600 tokens ahead is 1.5 s of queue.
    peers.ahead = 9600.0
    s = drained.score(r, [a, b])
    assert s[1] == 1.0 and s[0] < 0.7


def test_the_default_drains_the_peers_inflight_tokens():
    # Measured better on 3 replicas in every interleaved tenants pair on a quiet machine
    # (bench/RESULTS.md, issue 14, tenth session, second part); one replica is unchanged.
    assert PredictedTTFTScorer.Params().peer_inflight == "drained"
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=12_800)
    b = cand("b", prefill_tps=6400.0)
    default = PredictedTTFTScorer(UNTIL_END, clock=Clock())
    default.peer_arrivals = Peers(12_800, 0.0)
    s = default.score(r, [a, b])
    assert s[0] == 1.0 and s[1] < 0.2  # the peers' prefill is done: the holder keeps it
    assert default.peer_tokens_drained == 12_800


def test_drained_peers_leave_a_replicas_own_inflight_whole():
    # One replica's own in-flight tokens count until they end, drained or not: of 12,800 in
    # flight on a, 6,400 are the peers' (drained) and 6,400 this replica's (1 s of queue).
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=12_800)
    b = cand("b", prefill_tps=6400.0)
    drained = peer_scorer("drained", Clock())
    drained.peer_arrivals = Peers(6400, 0.0)
    s = drained.score(r, [a, b])
    # a: 1 s + 0 uncached + floor; b: 1 s to recompute: b by the fixed cost (a tie).
    assert s[0] == pytest.approx(1.0, abs=0.01) and s[1] == 1.0
    # No peers seen (a single replica, or counts not shared): every token counts.
    alone = peer_scorer("drained", Clock())
    assert alone.score(r, [a, b]) == peer_scorer("whole", Clock()).score(r, [a, b])
    alone.peer_arrivals = Peers(0, 0.0)
    assert alone.score(r, [a, b]) == peer_scorer("whole", Clock()).score(r, [a, b])
    assert alone.peer_tokens_drained == 0


def test_drained_peers_with_the_fleets_placements_folded_take_no_floor():
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=12_800)
    b = cand("b", prefill_tps=6400.0)
    sc = peer_scorer("drained", Clock())
    peers = Peers(12_800, 12_800.0)
    sc.peer_arrivals = peers
    sc.fleet_folded = lambda: True
    s = sc.score(r, [a, b])
    assert s[0] == 1.0 and not peers.asked


def test_drained_floor_is_the_virtual_queue_plus_the_peers_undrained_tokens():
    # `inflightFloor: drained`: in-flight tokens are no floor at all (this replica's own
    # placements are its virtual queue); the peers' count on top, as far as not computed.
    clock = Clock()
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=12_800)
    b = cand("b", prefill_tps=6400.0)
    sc = PredictedTTFTScorer(
        PredictedTTFTScorer.Params(inflight_floor="drained", spill_cost="ignore"), clock=clock
    )
    s = sc.score(r, [a, b])
    assert s[0] == 1.0 and s[1] < 0.2  # alone: nothing queued in its own books
    place(sc, req(blocks=10, tokens=3200), [cand("a", prefill_tps=6400.0)], "a")  # 0.5 s
    peers = Peers(12_800, 3200.0)  # 0.5 s of the peers' not computed yet
    sc.peer_arrivals = peers
    s = sc.score(r, [a, b])
    # a: 0.5 + 0.5 s ahead, nothing uncached; b: 1 s to recompute: a tie by the fixed cost.
    assert s[0] == pytest.approx(1.0, abs=0.01) and s[1] == 1.0
    sc.fleet_folded = lambda: True  # the peers' placements are in the queue already
    peers.asked.clear()
    s = sc.score(r, [a, b])
    assert s[0] == 1.0 and s[1] < 0.6 and not peers.asked


def test_by_default_requests_in_flight_are_no_floor_beyond_the_virtual_queue():
    # A tenant's holder at the knee: 12,800 uncached tokens this picker placed are still in
    # flight there (decoding their answers), their prefill long done. Counted until they
    # end (`untilEnd`, the default before the fifteenth session) they were 2 s of queue and
    # the request left for a cold server (1 s to recompute); by default the queue ahead is
    # what the picker's own virtual queue still holds.
    assert PredictedTTFTScorer.Params().inflight_floor == "drained"
    clock = Clock()
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_requests=4, inflight_tokens=12_800)
    b = cand("b", prefill_tps=6400.0)
    default = PredictedTTFTScorer(NO_SPILL, clock=clock)  # the floor's default alone
    s = default.score(r, [a, b])
    assert s[0] == 1.0 and s[1] < 0.2
    s = PredictedTTFTScorer(UNTIL_END, clock=clock).score(r, [a, b])
    assert s[1] == 1.0 and s[0] < 0.6
    # What the picker placed is still queued while its prefill runs: 1.5 s on a now.
    place(default, req(blocks=10, tokens=9600), [cand("a", prefill_tps=6400.0)], "a")
    s = default.score(r, [a, b])
    assert s[1] == 1.0 and s[0] < 0.7
    assert default.explain(r, [a, b])[0]["queue_s"] == pytest.approx(1.5)
    # Scraped waiting requests still floor it (another client's work, say).
    clock.t += 10.0
    busy = cand("a", prefix=10, prefill_tps=6400.0, waiting=3, inflight_tokens=12_800)
    s = default.score(r, [busy, b])
    assert s[1] == 1.0 and s[0] < 0.6


def test_explain_gives_each_term_of_the_prediction_scored():
    clock = Clock()
    sc = PredictedTTFTScorer(UNTIL_END, clock=clock)
    for _ in range(40):  # a mean placed prefill near 1,000 tokens
        place(sc, req(blocks=10, tokens=1000), [cand("z", prefill_tps=1e9)], "z")
    place(sc, req(blocks=10, tokens=2000), [cand("a", prefill_tps=1000.0)], "a")  # 2 s queued
    r = req(blocks=10, tokens=1000)
    cands = [
        cand("a", prefix=8, prefill_tps=1000.0, waiting=1, kv_usage=0.5),
        cand("b", prefill_tps=1000.0, waiting=3, inflight_tokens=500, inflight_requests=1),
    ]
    scores = sc.score(r, cands)
    a, b = sc.explain(r, cands)
    # a: its virtual queue (2 s) beats one waiting request at the mean prefill (1,050
    # tokens once the 2,000-token placement moved it).
    assert a["virtual_queue_s"] == pytest.approx(2.0) and a["queue_s"] == pytest.approx(2.0)
    assert a["waiting_floor_s"] == pytest.approx(1.05) and a["mean_prefill"] == 1050
    assert a["uncached_s"] == pytest.approx(0.2) and a["kv_usage"] == 0.5
    # The eviction cost's inputs: nothing placed was cached (reuse share 0); a was written
    # the 2,000-token prompt, b nothing.
    assert a["reuse_share"] == 0.0 and a["written"] == 2000.0 and b["written"] == 0.0
    # b: 3 waiting at 1,050 tokens (3.15 s) beat 500 in-flight tokens (0.5 s).
    assert b["inflight_floor_s"] == pytest.approx(0.5)
    assert b["queue_s"] == pytest.approx(b["waiting_floor_s"]) and b["waiting"] == 3
    for t in (a, b):  # the terms add up to what was scored
        assert t["predicted_s"] == pytest.approx(t["queue_s"] + t["uncached_s"] + 0.005)
    assert scores[1] / scores[0] == pytest.approx(a["predicted_s"] / b["predicted_s"])


def test_shared_lane_drains_the_peers_tokens_behind_this_replicas_own():
    # One exchange brought b 1,600 tokens this replica placed and 6,400 of the peers' (own
    # ahead); 1 s later a lane at 6,400 tokens/s computed 6,400 of the 8,000: the 1,600 left
    # are the peers'. `drained` runs a lane for the peers alone: all theirs done, b's queue
    # reads 0.25 s (its own, whole) and the request leaves its holder a (1.4 s of own work
    # ahead) for b's 1 s recompute. The shared lane counts 0.25 + 0.25 s there: a keeps it.
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=8960)
    b = cand("b", prefill_tps=6400.0, inflight_tokens=8000)
    clock = Clock()
    arrivals = PeerArrivals()
    arrivals.update({"b": 6400}, now=clock.t - 1.0, own={"a": 8960, "b": 1600})
    scores = {}
    for mode in ("drained", "sharedLane"):
        sc = peer_scorer(mode, clock)
        sc.peer_arrivals = arrivals
        scores[mode] = sc.score(r, [a, b])
        assert sc.peer_tokens_drained == pytest.approx(6400 if mode == "drained" else 4800)
        terms = sc.explain(r, [a, b])
        assert terms[1]["inflight_floor_s"] == pytest.approx(0.25 if mode == "drained" else 0.5)
        assert terms[1]["peer_inflight_tokens"] == 6400  # the peers' share, explained
    assert scores["drained"][1] == 1.0 and scores["drained"][0] < 0.95
    assert scores["sharedLane"][0] == 1.0 and scores["sharedLane"][1] < 0.95
    # Without own arrivals on b the two drain alike.
    bare = PeerArrivals()
    bare.update({"b": 6400}, now=clock.t - 1.0, own={"a": 8960})
    alike = []
    for mode in ("drained", "sharedLane"):
        sc = peer_scorer(mode, clock)
        sc.peer_arrivals = bare
        alike.append(sc.score(r, [a, b]))
    assert alike[0] == alike[1]


def test_shared_lane_leaves_one_replica_unchanged():
    # No peers (one replica, or counts not shared): every in-flight token counts whole.
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=8960)
    b = cand("b", prefill_tps=6400.0, inflight_tokens=1600)
    alone = PeerArrivals()
    alone.update({}, now=Clock.t - 1.0, own={"a": 8960, "b": 1600})
    for arrivals in (None, alone):
        got = []
        for mode in ("whole", "drained", "sharedLane"):
            sc = peer_scorer(mode, Clock())
            sc.peer_arrivals = arrivals
            got.append(sc.score(r, [a, b]))
        assert got[0] == got[1] == got[2]


def test_explaining_a_scored_decision_counts_nothing_again():
    # `explain` re-runs `predict` for its terms after `score`: the drained-tokens and
    # floor-fallback counters must move with scoring only, or every explained decision
    # (and every /debug/explain probe) counted twice.
    r = req(blocks=10, tokens=6400)
    a = cand("a", prefix=10, prefill_tps=6400.0, inflight_tokens=12_800)
    b = cand("b", prefill_tps=6400.0)
    sc = peer_scorer("drained", Clock())
    sc.peer_arrivals = Peers(12_800, 0.0)
    sc.explain(r, [a, b])
    assert sc.peer_tokens_drained == 0
    sc.score(r, [a, b])
    assert sc.peer_tokens_drained == 12_800
    terms = sc.explain(r, [a, b])
    assert sc.peer_tokens_drained == 12_800
    assert terms[0]["peer_inflight_tokens"] == 12_800  # the explanation still has the term
    # The first-token floor without the engine's count: one fallback per scored prediction.
    fb = PredictedTTFTScorer(FIRST_TOKEN, clock=Clock())
    busy = cand("a", prefix=10, prefill_tps=6400.0, inflight_requests=4, inflight_tokens=12_800)
    fb.explain(r, [busy, b])
    assert fb.floor_fallbacks == 0
    fb.score(r, [busy, b])
    assert fb.floor_fallbacks == 1
    fb.explain(r, [busy, b])
    assert fb.floor_fallbacks == 1


def test_speed_units_estimates_drains_estimated_queues_at_their_real_speed():
    # Uncalibrated: 3 engine tokens per estimated token. A 6,400-token (estimated) prompt
    # placed on a is 19,200 engine tokens, 3 s at the engine's 6,400 tok/s; taken in the
    # engine's unit the virtual queue said 1 s, and 0.5 s later 0.5 s (drained 3x too fast).
    r = req(blocks=10, tokens=6400)
    clock = Clock()

    def queue(units: str, ratio: float | None) -> float:
        sc = PredictedTTFTScorer(PredictedTTFTScorer.Params(speed_units=units), clock=clock)
        if ratio is not None:
            sc.token_ratio = lambda: ratio
        cands = [cand("a", prefill_tps=6400.0), cand("b", prefill_tps=6400.0)]
        t0 = clock.t
        place(sc, r, cands, "a")
        clock.t = t0 + 0.5
        terms: dict[str, float] = {}
        sc.predict(req(blocks=10, tokens=640), cands[0], clock.t, terms)
        clock.t = t0
        return terms["virtual_queue_s"]

    assert queue("engine", 3.0) == pytest.approx(0.5)  # the default: the ratio is not read
    assert queue("estimates", 3.0) == pytest.approx(2.5)
    assert queue("estimates", None) == pytest.approx(0.5)  # no approximate index: as engine
    assert queue("estimates", 0.0) == pytest.approx(0.5)  # nonsense ratio: ignored
    # The peers' lane too: 6,400 estimated tokens arrived 0.5 s ago are 2.5 s still ahead.
    sc = PredictedTTFTScorer(PredictedTTFTScorer.Params(speed_units="estimates"), clock=clock)
    sc.token_ratio = lambda: 3.0
    peers = Peers(6400, 6400.0)
    sc.peer_arrivals = peers
    sc.predict(r, cand("a", prefill_tps=6400.0, inflight_tokens=6400), clock.t)
    assert peers.asked[-1] == ("a", clock.t, pytest.approx(6400.0 / 3))
    # An endpoint not measured yet keeps the prior (in no unit in particular).
    assert sc._tps(cand("c")) == 10_000.0
    assert PredictedTTFTScorer.Params().speed_units == "engine"


# `kvFit: wait`: a 6,400-token cache (400 blocks x 16), 2,560-token prompts (40% of it), the
# tenants knee's shape (bench/RESULTS.md, issue 14, eighteenth session).
KV = {"kv_blocks": 400, "kv_block_size": 16, "prefill_tps": 10_000.0}
KV_FIT = PredictedTTFTScorer.Params(kv_fit="wait", spill_cost="ignore")
ARRIVALS = PredictedTTFTScorer.Params(kv_fit="wait", kv_fit_peers="arrivals", spill_cost="ignore")
# The nineteenth session's count: the cached prefix costs no block anywhere.
KV_HELD = PredictedTTFTScorer.Params(kv_fit="wait", kv_fit_prefix="held", spill_cost="ignore")


def test_kv_fit_waits_for_the_earliest_running_end_where_the_prompt_does_not_fit():
    clock = Clock()
    sc = PredictedTTFTScorer(KV_HELD, clock=clock)
    sc.decode_s = lambda address: 0.3
    r = req(blocks=40, tokens=2560)
    # a holds half the prompt, and its running requests 85% of its cache: the other half
    # (1,280 tokens, 20%) does not fit.
    full = cand("a", prefix=20, kv_usage=0.85, running=2, **KV)
    terms = sc.explain(r, [full])[0]
    # No placement of this scorer's runs there: the sooner of 2 running decodes, 0.3 / 3.
    assert terms["kv_fit_wait_s"] == pytest.approx(0.1)
    assert terms["queue_s"] == pytest.approx(0.1)
    assert sc.predict(r, full, clock.t) == pytest.approx(0.1 + 1280 / 10_000 + 0.005)
    # With room (0.75 + 0.2 <= 1) no wait; `ignore` (the default) never waits.
    room = cand("a", prefix=20, kv_usage=0.75, running=2, **KV)
    assert sc.explain(r, [room])[0]["kv_fit_wait_s"] == 0.0
    # The cached part costs no block: held 90%, the 256 tokens left fit beside 85%.
    held = cand("a", prefix=36, kv_usage=0.85, running=2, **KV)
    assert sc.explain(r, [held])[0]["kv_fit_wait_s"] == 0.0
    assert "kv_fit_wait_s" not in PredictedTTFTScorer(clock=clock).explain(r, [full])[0]
    assert sc.kv_fit_waits == 1 and sc.kv_fit_untimed == 0  # explanations are not counted


def test_kv_fit_counts_placements_since_the_scrape_and_times_the_wait_by_their_ends():
    clock = Clock()
    sc = PredictedTTFTScorer(KV_FIT, clock=clock)
    sc.decode_s = lambda address: 0.3
    r = req(blocks=40, tokens=2560)
    # Scraped 40 ms ago at 30%: two cold 2,560-token prompts placed since fill it (0.3 + 0.8).
    place(sc, r, [cand("a", **KV)], "a")  # prefill 0.256 s, ends at +0.556 s
    clock.t += 0.01
    place(sc, r, [cand("a", **KV)], "a")  # behind it: prefill ends at +0.512, ends +0.812
    clock.t += 0.002
    scraped = cand("a", kv_usage=0.3, age_s=0.04, **KV)
    # The earliest of them to end: the first, 0.556 - 0.012 s from now; the prefill queue
    # ahead is 0.5 s, so the wait adds 0.044 s to it.
    terms = sc.explain(r, [scraped])[0]
    assert terms["kv_fit_wait_s"] == pytest.approx(0.544)
    assert terms["virtual_queue_s"] == pytest.approx(0.5)
    assert terms["queue_s"] == pytest.approx(0.544)
    # Scraped after both were placed: its usage holds them, not counted again (0.3 + 0.4).
    assert sc.explain(r, [cand("a", kv_usage=0.3, age_s=0.001, **KV)])[0]["kv_fit_wait_s"] == 0
    # Once both are expected to have ended, a full scrape waits for the running requests.
    clock.t += 1.0
    late = cand("a", kv_usage=0.7, running=1, **KV)
    assert sc.explain(r, [late])[0]["kv_fit_wait_s"] == pytest.approx(0.15)


def test_kv_fit_changes_the_pick_to_a_server_with_room_and_counts_it():
    clock = Clock()
    sc = PredictedTTFTScorer(KV_FIT, clock=clock)
    sc.decode_s = lambda address: 0.6
    r = req(blocks=40, tokens=2560)
    # a holds 60% of the prompt but is full (0.9 + 0.16; wait 0.6 / 2 = 0.3 s + 0.102 s
    # prefill); b is cold with room (0.3 + 0.4; 0.256 s).
    cands = [
        cand("a", prefix=24, kv_usage=0.9, running=1, **KV),
        cand("b", kv_usage=0.3, running=1, **KV),
    ]
    s = sc.score(r, cands)
    assert s[1] == 1.0 and s[0] < 1.0
    assert sc.kv_fit_changed == 1 and sc.kv_fit_waits == 1
    # Without the term a wins, as before.
    assert PredictedTTFTScorer(clock=clock).score(r, cands)[0] == 1.0
    # A short wait (decodes of 0.1 s) keeps the request on its holder: nothing changed.
    sc.decode_s = lambda address: 0.1
    assert sc.score(r, cands)[0] == 1.0
    assert sc.kv_fit_changed == 1


def test_kv_fit_without_a_decode_time_counts_untimed_and_skips_unknown_caches(caplog):
    clock = Clock()
    sc = PredictedTTFTScorer(KV_FIT, clock=clock)
    r = req(blocks=40, tokens=2560)
    full = cand("a", kv_usage=0.9, running=2, **KV)
    sc.score(r, [full])
    assert sc.kv_fit_untimed == 1 and sc.kv_fit_waits == 1
    assert "no engine's decode time measured" in caplog.text
    # Capacity unknown, a stale scrape, or a prompt bigger than the cache: no wait.
    sc.decode_s = lambda address: 0.3
    assert sc.explain(r, [cand("a", kv_usage=0.9, running=2)])[0]["kv_fit_wait_s"] == 0
    stale = cand("a", kv_usage=0.9, running=2, age_s=5.0, **KV)
    assert sc.explain(r, [stale])[0]["kv_fit_wait_s"] == 0
    huge = req(blocks=40, tokens=7000)
    assert sc.explain(huge, [full])[0]["kv_fit_wait_s"] == 0


def test_kv_fit_converts_estimated_tokens_by_the_capacity_ratio():
    clock = Clock()
    sc = PredictedTTFTScorer(KV_FIT, clock=clock)
    sc.decode_s = lambda address: 0.3
    r = req(blocks=40, tokens=1280)  # 1,280 estimated tokens, 20% of the cache as estimated
    half = cand("a", kv_usage=0.7, running=2, **KV)
    assert sc.explain(r, [half])[0]["kv_fit_wait_s"] == 0
    sc.token_ratio = lambda: 2.0  # each estimate is 2 engine tokens: 40%, does not fit
    assert sc.explain(r, [half])[0]["kv_fit_wait_s"] == pytest.approx(0.1)


def test_kv_fit_counts_the_peers_placements_since_the_scrape_from_the_exchange():
    # Three replicas raced for the same free KV: one placed a cold prompt on `a` and, before
    # any scrape showed it, another replica placed there too (bench/RESULTS.md, issue 14,
    # twentieth session). The in-flight exchange's arrivals (pushed at decision time) are
    # counted as placed since the scrape.
    clock = Clock()
    sc = PredictedTTFTScorer(ARRIVALS, clock=clock)
    sc.decode_s = lambda address: 0.3
    arrivals = PeerArrivals()
    sc.peer_arrivals = arrivals
    r = req(blocks=40, tokens=2560)
    # Scraped 50 ms ago at 40%: this request (40%) fits, alone.
    scraped = cand("a", kv_usage=0.4, running=1, age_s=0.05, **KV)
    assert sc.explain(r, [scraped])[0]["kv_fit_wait_s"] == 0
    # A peer placed 2,560 uncached tokens there 20 ms ago: 0.4 + 0.4 + 0.4 > 1, it waits
    # for the running request (0.3 / 2), and the peers alone made it wait.
    arrivals.arrive("a", 2560, clock.t - 0.02)
    terms = sc.explain(r, [scraped])[0]
    assert terms["kv_fit_wait_s"] == pytest.approx(0.15)
    assert terms["kv_peer_tokens"] == 2560
    # Scored: counted as a wait, and one the peers alone caused. (The peer's tokens also
    # queue ahead as far as a lane has not computed them: 0.236 s, the larger floor here.)
    sc.score(r, [scraped])
    assert (sc.kv_fit_waits, sc.kv_fit_peers) == (1, 1)
    # Placed before the scrape: its usage holds them already, not counted again.
    fresh = sc.explain(r, [cand("a", kv_usage=0.4, running=1, age_s=0.01, **KV)])[0]
    assert fresh["kv_fit_wait_s"] == 0 and fresh["kv_peer_tokens"] == 0
    # Estimates: the peers' counts are in them too, converted by the same ratio.
    small = req(blocks=40, tokens=1280)
    assert sc.explain(small, [scraped])[0]["kv_fit_wait_s"] == 0  # 0.4 + 0.4 + 0.2
    sc.token_ratio = lambda: 1.2  # 0.4 + 0.48 + 0.24 > 1
    assert sc.explain(small, [scraped])[0]["kv_fit_wait_s"] == pytest.approx(0.15)


def test_kv_fit_peers_are_not_counted_twice_when_folded_or_when_told_not_to():
    clock = Clock()
    arrivals = PeerArrivals()
    arrivals.arrive("a", 2560, clock.t - 0.02)
    r = req(blocks=40, tokens=2560)
    scraped = cand("a", kv_usage=0.4, running=1, age_s=0.05, **KV)
    # The peers' placements folded in (shared placements): already in this scorer's own
    # record of placements, so the exchange's arrivals are left out.
    sc = PredictedTTFTScorer(ARRIVALS, clock=clock)
    sc.decode_s = lambda address: 0.3
    sc.peer_arrivals = arrivals
    sc.fleet_folded = lambda: True
    assert sc.explain(r, [scraped])[0]["kv_fit_wait_s"] == 0
    assert sc.fold("a", 2560, 2560, 0.256, 0.02)  # the same placement, folded: counted once
    assert sc.explain(r, [scraped])[0]["kv_fit_wait_s"] > 0
    # While Redis fails the fold stops, and the exchange's arrivals count again.
    sc2 = PredictedTTFTScorer(ARRIVALS, clock=clock)
    sc2.decode_s = lambda address: 0.3
    sc2.peer_arrivals = arrivals
    sc2.fleet_folded = lambda: False
    assert sc2.explain(r, [scraped])[0]["kv_fit_wait_s"] > 0
    # `kvFitPeers: folded` (the default, the behaviour before): the peers' arrivals ignored.
    before = PredictedTTFTScorer(KV_FIT, clock=clock)
    before.decode_s = lambda address: 0.3
    before.peer_arrivals = arrivals
    terms = before.explain(r, [scraped])[0]
    assert terms["kv_fit_wait_s"] == 0 and terms["kv_peer_tokens"] == 0
    assert PredictedTTFTScorer.Params().kv_fit_peers == "folded"


def keyed(r, keys):
    """`r` with other block keys (another request of the same tenant, or another tenant)."""
    return dataclasses.replace(r, block_keys=tuple(keys))


def test_kv_fit_counts_a_cached_prefix_no_running_placement_shares():
    clock = Clock()
    sc = PredictedTTFTScorer(KV_FIT, clock=clock)
    sc.decode_s = lambda address: 0.3
    r = req(blocks=40, tokens=2560)
    # a holds 90% of the prompt and its running requests 70% of its cache. Taken as held,
    # the 256 uncached tokens (4%) fit; but no placement running there shares the prefix,
    # so its 2,304 cached tokens leave the free pool too (0.7 + 0.4 > 1): the wait.
    a = cand("a", prefix=36, kv_usage=0.7, running=2, **KV)
    assert PredictedTTFTScorer(KV_HELD, clock=clock).explain(r, [a])[0]["kv_fit_wait_s"] == 0
    assert sc.explain(r, [a])[0]["kv_fit_wait_s"] == pytest.approx(0.1)
    sc.score(r, [a])
    assert sc.kv_fit_waits == 1 and sc.kv_fit_idle_prefix == 1
    # Another turn of the same conversation (its first 36 blocks) placed there and running:
    # the prefix is shared, only the uncached part counts.
    place(sc, keyed(r, [*range(1, 37), 90, 91]), [cand("a", prefix=36, **KV)], "a")
    assert sc.explain(r, [a])[0]["kv_fit_wait_s"] == 0
    # Another tenant running there shares the header (4 blocks): the other 32 count, and
    # the wait is until that placement ends (853 uncached tokens' prefill, 0.3 s decode).
    other = PredictedTTFTScorer(KV_FIT, clock=clock)
    other.decode_s = lambda address: 0.3
    place(other, keyed(r, [1, 2, 3, 4, 50, 51]), [cand("a", prefix=4, **KV)], "a")
    assert other.explain(r, [a])[0]["kv_fit_wait_s"] == pytest.approx(2560 / 3 / 10_000 + 0.3)
    # Once the sharing placement has ended (prefill + 0.3 s decode), the prefix counts again.
    clock.t += 1.0
    assert sc.explain(r, [a])[0]["kv_fit_wait_s"] == pytest.approx(0.1)
    # A cold candidate holds nothing cached: its whole prompt is uncached either way.
    cold = cand("b", kv_usage=0.7, running=2, **KV)
    assert sc.explain(r, [cold])[0]["kv_fit_wait_s"] == pytest.approx(0.1)


def test_kv_fit_takes_the_prefix_as_held_where_peers_have_requests_in_flight(caplog):
    clock = Clock()
    sc = PredictedTTFTScorer(KV_FIT, clock=clock)
    sc.decode_s = lambda address: 0.3
    arrivals = PeerArrivals()
    arrivals.update({"a": 2560}, now=clock.t - 0.1, own={})
    sc.peer_arrivals = arrivals
    r = req(blocks=40, tokens=2560)
    # A peer's request on a may share the prefix (its keys are not known here): as held.
    a = cand("a", prefix=36, kv_usage=0.7, running=2, **KV)
    sc.score(r, [a])
    assert sc.kv_fit_waits == 0 and sc.kv_fit_prefix_unknown == 1
    assert "other replicas have requests in flight" in caplog.text
    # No peer request on b: its cached prefix counts.
    b = cand("b", prefix=36, kv_usage=0.7, running=2, **KV)
    sc.score(r, [b])
    assert sc.kv_fit_waits == 1 and sc.kv_fit_idle_prefix == 1


def test_kv_fit_margin_keeps_a_request_on_its_holder_unless_the_wait_exceeds_it():
    clock = Clock()
    r = req(blocks=40, tokens=2560)
    # a holds 60% of the prompt but is full: 0.3 s until its running request ends, then
    # 0.102 s of prefill; b is cold with room: 0.256 s.
    cands = [
        cand("a", prefix=24, kv_usage=0.9, running=1, **KV),
        cand("b", kv_usage=0.3, running=1, **KV),
    ]
    picks = {}
    for margin in (0.0, 0.1, 0.2):
        sc = PredictedTTFTScorer(
            PredictedTTFTScorer.Params(kv_fit="wait", kv_fit_margin=margin, spill_cost="ignore"),
            clock=clock,
        )
        sc.decode_s = lambda address: 0.6
        s = sc.score(r, cands)
        picks[margin] = "a" if s[0] == 1.0 else "b"
        terms = sc.explain(r, cands)
        assert terms[0]["kv_fit_margin_s"] == pytest.approx(margin)
        assert terms[0]["predicted_s"] == pytest.approx(0.3 + 0.1024 + 0.005)  # unchanged
        assert terms[1]["kv_fit_margin_s"] == 0.0  # b holds nothing: no margin
        assert sc.kv_fit_changed == (1 if picks[margin] == "b" else 0)
    # The wait exceeds the 0.154 s recompute elsewhere by more than 0.1 s, not by 0.2 s.
    assert picks == {0.0: "b", 0.1: "b", 0.2: "a"}
    # Where both hold the same part (a header), neither gets a margin.
    sc = PredictedTTFTScorer(
        PredictedTTFTScorer.Params(kv_fit="wait", kv_fit_margin=0.2, spill_cost="ignore"),
        clock=clock,
    )
    sc.decode_s = lambda address: 0.6
    even = [
        cand("a", prefix=4, kv_usage=0.9, running=1, **KV),
        cand("b", prefix=4, kv_usage=0.3, running=1, **KV),
    ]
    assert sc.score(r, even)[1] == 1.0
    assert [t["kv_fit_margin_s"] for t in sc.explain(r, even)] == [0.0, 0.0]


class Placements:
    """The peers' placements as the shared in-flight exchange counts them, cumulative."""

    def __init__(self) -> None:
        self.n, self.tokens = 0, 0

    def add(self, n: int, tokens: int) -> None:
        self.n, self.tokens = self.n + n, self.tokens + tokens

    def __call__(self) -> tuple[int, int]:
        return self.n, self.tokens


def test_fleet_mean_placements_average_the_peers_placements_as_one_replica_would():
    # A fleet's placements: a cold prompt first (6,400 uncached), then hits of 640. One
    # replica sees 30; each of three sees its cold one and 9 hits, the peers place 20 more.
    params = (
        PredictedTTFTScorer.Params(),  # one replica: no peers, whatever the setting
        PredictedTTFTScorer.Params(mean_placements="own"),
        PredictedTTFTScorer.Params(mean_placements="fleet"),  # the default
    )
    one, own, pooled = (PredictedTTFTScorer(p, clock=Clock()) for p in params)
    peers = Placements()
    own.peer_placements = pooled.peer_placements = peers
    z = [cand("z", prefill_tps=1e9)]
    place(one, req(blocks=100, tokens=6400), z, "z")
    for sc in (own, pooled):
        place(sc, req(blocks=100, tokens=6400), z, "z")
    r = req(blocks=100, tokens=6400)
    for _ in range(29):
        place(one, req(blocks=100, tokens=640), z, "z")
    for i in range(9):
        for sc in (own, pooled):
            place(sc, req(blocks=100, tokens=640), z, "z")
        k = 3 if i < 2 else 2  # the peers' arrivals between two decisions here
        peers.add(k, k * 640)
        for sc in (own, pooled):
            sc.score(r, z)
    # One replica: ~640 + 5,760 x 0.95^29 = ~2,000; pooled the same; its own a third as fast.
    assert pooled.mean_prefill == pytest.approx(one.mean_prefill, rel=0.02)
    assert own.mean_prefill > 1.5 * one.mean_prefill
    assert pooled.mean_pooled == 20 and own.mean_pooled == 0
    # What it is for: each scraped waiting request counts at that mean.
    holder = cand("a", prefix=95, prefill_tps=6400.0, waiting=3)
    (t_pooled,) = pooled.explain(r, [holder])
    (t_one,) = one.explain(r, [holder])
    assert t_pooled["waiting_floor_s"] == pytest.approx(t_one["waiting_floor_s"], rel=0.02)


def test_fleet_mean_placements_skip_the_peers_while_folded_and_odd_counts():
    sc = PredictedTTFTScorer(PredictedTTFTScorer.Params(mean_placements="fleet"), clock=Clock())
    z = [cand("z", prefill_tps=1e9)]
    r = req(blocks=100, tokens=640)
    sc.score(r, z)  # nothing wired: a lone replica, nothing to pool
    peers = Placements()
    sc.peer_placements = peers
    place(sc, req(blocks=100, tokens=6400), z, "z")
    folded = [True]
    sc.fleet_folded = lambda: folded[0]
    peers.add(50, 50 * 640)  # folded: `fold` put these in the mean already
    sc.score(r, z)
    assert sc.mean_prefill == 6400 and sc.mean_pooled == 0
    folded[0] = False  # unfolded (Redis failing, say): only what comes after pools
    peers.add(1, 640)
    sc.score(r, z)
    assert sc.mean_prefill == pytest.approx(640 + 5760 * 0.95) and sc.mean_pooled == 1
    peers.add(1, -10_000)  # tokens going back: not a placement
    sc.score(r, z)
    assert sc.mean_pooled == 1


def _spill_fleet(params: PredictedTTFTScorer.Params, busy: tuple[str, ...]):
    """A scorer whose virtual queues hold 0.3 s of prefill on the holder `h` and 0.5 s on each
    endpoint in `busy`, everything at 10,000 tok/s."""
    sc = PredictedTTFTScorer(params, clock=Clock())
    place(sc, req(blocks=30, tokens=3000), [cand("h", prefill_tps=1e4)], "h")
    for addr in busy:
        place(sc, req(blocks=50, tokens=5000), [cand(addr, prefill_tps=1e4)], addr)
    return sc


SPILL = PredictedTTFTScorer.Params(spill_cost="fleetBusy")


def test_spill_cost_keeps_a_repeat_on_its_holder_while_the_fleet_is_busy():
    # The repeat: 2,000 tokens, all held by h (0.3 s queued there); x is idle and cold (a
    # 0.2 s recompute); c and d are busy. Predicted alone, x is sooner (0.205 s vs 0.305 s).
    r = req(blocks=20, tokens=2000)
    cands = [cand(a, prefix=20 if a == "h" else 0, prefill_tps=1e4) for a in "hxcd"]
    plain = _spill_fleet(NO_SPILL, ("c", "d"))
    assert plain.score(r, cands)[1] == 1.0
    # Three of four lanes busy: x is charged 0.75 x its extra 0.2 s of prefill and the repeat
    # stays where its prefix is.
    assert PredictedTTFTScorer.Params().spill_cost == "fleetBusy"  # the default
    sc = _spill_fleet(SPILL, ("c", "d"))
    s = sc.score(r, cands)
    assert s[0] == 1.0 and s[1] == pytest.approx(0.305 / 0.355)
    assert (sc.spill_charged, sc.spill_changed) == (1, 1)
    terms = sc.explain(r, cands)
    assert [t["fleet_busy"] for t in terms] == [0.75] * 4
    assert [t["spill_cost_s"] for t in terms] == pytest.approx([0.0, 0.15, 0.15, 0.15])
    assert terms[1]["predicted_s"] == pytest.approx(0.205)  # the prediction itself unchanged
    assert (sc.spill_charged, sc.spill_changed) == (1, 1)  # explaining counts nothing


def test_spill_cost_lets_a_repeat_leave_a_long_holder_queue_on_an_idle_fleet():
    # Only the holder is busy: x is charged 0.25 x 0.2 s, 0.255 s against the holder's 0.305 s.
    r = req(blocks=20, tokens=2000)
    cands = [cand(a, prefix=20 if a == "h" else 0, prefill_tps=1e4) for a in "hxyz"]
    sc = _spill_fleet(SPILL, ())
    s = sc.score(r, cands)
    assert s[1] == 1.0 and s[0] == pytest.approx(0.255 / 0.305)
    assert (sc.spill_charged, sc.spill_changed) == (1, 0)
    # A new prefix (no candidate holds more than another) is charged nothing anywhere, so
    # spreading new groups is left as it was.
    fresh = [cand(a, prefill_tps=1e4) for a in "hxyz"]
    assert sc.score(r, fresh) == pytest.approx([0.205 / 0.505, 1.0, 1.0, 1.0])
    assert sc.spill_charged == 1


def test_written_placements_default_to_the_fleets():
    assert PredictedTTFTScorer.Params().written_placements == "fleet"


def test_fleet_written_placements_fill_a_cache_as_one_replica_would():
    # Three replicas share two servers of 6,400 tokens each; six prompts of 3,200 uncached
    # tokens (half of each cached) go three to a server: one replica placing them all counts
    # 9,600 written on each, its cache full. A replica that placed two of them (one a
    # server) counts 3,200 written with `own`: the next cold prompt (6,400) evicts only what
    # passes the room left. With `fleet` the four its peers placed come from the shared
    # in-flight exchange: it counts what one replica counts, and the cold prompt evicts all
    # it writes (the chance an evicted token is needed again, the reuse share, is each
    # replica's own measurement: `own` and `fleet` placed alike here).
    full = {"kv_blocks": 400, "kv_block_size": 16}
    clock = Clock()
    params = (
        PredictedTTFTScorer.Params(),
        PredictedTTFTScorer.Params(written_placements="own"),
        PredictedTTFTScorer.Params(written_placements="fleet"),
    )
    one, own, fleet = (PredictedTTFTScorer(p, clock=clock) for p in params)
    peers = PeerArrivals()
    own.peer_arrivals = fleet.peer_arrivals = peers
    for i in range(6):
        addr = "ab"[i % 2]
        c = cand(addr, prefix=50, prefill_tps=6400.0, **full)
        r = req(blocks=100, tokens=6400)
        place(one, r, [c], addr)
        if i < 2:
            place(own, r, [c], addr)
            place(fleet, r, [c], addr)
        else:
            peers.arrive(addr, 3200, at=clock.t)
    clock.t += 10.0  # the queues drained
    r = req(blocks=100, tokens=6400)
    a = cand("a", prefix=50, prefill_tps=6400.0, **full)
    b = cand("b", prefill_tps=6400.0, **full)
    for sc in (one, own, fleet):
        sc.score(r, [a, b])
    assert own.view()["b"][1] == 3200.0 and own.written_pooled == 0.0
    assert fleet.view()["b"][1] == one.view()["b"][1] == 9600.0
    assert fleet.written_pooled == 4 * 3200.0
    assert own.eviction_cost(r, b) > 0.0
    assert fleet.eviction_cost(r, b) == pytest.approx(2 * own.eviction_cost(r, b))
    # Scored again: nothing new arrived, nothing counted twice.
    fleet.score(r, [a, b])
    assert fleet.view()["b"][1] == 9600.0 and fleet.written_pooled == 4 * 3200.0


def test_fleet_written_placements_skip_the_peers_while_folded_and_after_a_reset():
    clock = Clock()
    sc = PredictedTTFTScorer(PredictedTTFTScorer.Params(written_placements="fleet"), clock=clock)
    r = req(blocks=100, tokens=6400)
    a = [cand("a", prefill_tps=6400.0)]
    sc.score(r, a)  # nothing wired: a lone replica, nothing to pool
    peers = PeerArrivals()
    sc.peer_arrivals = peers
    folded = [True]
    sc.fleet_folded = lambda: folded[0]
    peers.arrive("a", 5000, at=clock.t)  # folded: `fold` wrote these already
    sc.score(r, a)
    assert sc.view().get("a", (0.0, 0.0))[1] == 0.0 and sc.written_pooled == 0.0
    folded[0] = False  # unfolded (Redis failing, say): only what comes after pools
    peers.arrive("a", 1000, at=clock.t)
    sc.score(r, a)
    assert sc.view()["a"][1] == 1000.0
    peers.arrive("a", 300, at=clock.t)  # placed before the restart, not yet scored here
    sc.endpoint_reset("a")  # restarted: what the peers wrote before is gone with the cache
    sc.score(r, a)
    assert sc.view().get("a", (0.0, 0.0))[1] == 0.0
    peers.arrive("a", 700, at=clock.t)
    sc.score(r, a)
    assert sc.view()["a"][1] == 700.0 and sc.written_pooled == 1700.0
