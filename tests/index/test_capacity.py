"""The approximate index credits a server with no more than its KV cache holds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from extproc.core import Candidate, Endpoint, EndpointState, InferenceRequest, LatencyTotals
from extproc.index.capacity import CapacityModel
from extproc.index.memory import MemoryKVIndex


def test_per_endpoint_capacity_drops_the_least_recently_written_prefixes():
    idx = MemoryKVIndex()
    idx.set_capacity("a", 10)
    first, second = list(range(1, 9)), list(range(100, 108))
    idx.record("a", first)
    idx.record("b", first)
    idx.record("a", second)  # 16 blocks > 10: the older prefix loses its tail first
    m1 = asyncio.run(idx.lookup(first)).matches
    m2 = asyncio.run(idx.lookup(second)).matches
    assert m2["a"] == 8
    assert m1["a"] == 2  # head kept, tail evicted
    assert m1["b"] == 8  # b has no learned capacity: unbounded as before


@dataclass(frozen=True)
class Scrape:
    prefix_cache_queries: int
    latency: LatencyTotals | None = None


def req(tokens: int) -> InferenceRequest:
    return InferenceRequest("r", "/v1/chat/completions", prompt_tokens=tokens, block_tokens=64)


def test_capacity_comes_from_cache_config_in_measured_tokens_per_block():
    sent: dict[str, int] = {}
    queries = {"a": 1000}
    model = CapacityModel(sent.__setitem__, lambda addr: Scrape(queries[addr]))
    cands = [Candidate(Endpoint("a"), EndpointState(kv_blocks=1000, kv_block_size=16))]
    model.update(req(100), cands)
    assert sent["a"] == 1000 * 16 // 64  # 250 of our blocks until a ratio is measured
    # The picker placed 32 x 1,000 estimated tokens; the engine counted 3x as many.
    for _ in range(32):
        model.placed("a", req(1000))
    queries["a"] += 96_000
    for _ in range(32):
        model.update(req(100), cands)
    assert abs(model.ratio - 3.0) < 1e-9
    assert sent["a"] == int(1000 * 16 / (64 * 3.0))


def test_a_change_of_estimate_units_carries_the_ratio_over_and_restarts_the_measurement():
    # Calibration went from 4 to 1 bytes per token: every estimate is 4x larger from now
    # on. A cumulative measurement would mix both units (here: ratio 1.5 instead of 0.75,
    # every server credited with half its cache).
    sent: dict[str, int] = {}
    queries = {"a": 0}
    model = CapacityModel(sent.__setitem__, lambda addr: Scrape(queries[addr]))
    cands = [Candidate(Endpoint("a"), EndpointState(kv_blocks=1000, kv_block_size=16))]
    model.update(req(100), cands)  # first scrape: the measurement's base
    for _ in range(32):
        model.placed("a", req(1000))  # 32,000 estimated tokens, 3x as many real ones
    queries["a"] += 96_000
    for _ in range(32):
        model.update(req(100), cands)
    assert abs(model.ratio - 3.0) < 1e-9
    model.units_changed(4.0)
    assert abs(model.ratio - 0.75) < 1e-9  # the same truth in the new unit
    model.update(req(100), cands)  # recomputed at once, and the new base taken
    assert sent["a"] == int(1000 * 16 / (64 * 0.75))
    for _ in range(32):
        model.placed("a", req(4000))  # the same prompts, estimated in the new unit
    queries["a"] += 96_000
    for _ in range(32):
        model.update(req(100), cands)
    assert abs(model.ratio - 0.75) < 1e-9  # measured anew: no old-unit estimates in it


def test_a_replica_placing_a_third_of_the_requests_measures_the_same_ratio():
    # Three replicas behind one gateway: this one placed 32 of the 96 requests the engine
    # served, 1,000 estimated tokens each, 3,000 real tokens each. Totals alone would give
    # 9.0 (every server credited with a third of its cache); per request it is 3.0.
    sent: dict[str, int] = {}
    state = {"a": Scrape(0, LatencyTotals())}
    model = CapacityModel(sent.__setitem__, lambda addr: state[addr])
    cands = [Candidate(Endpoint("a"), EndpointState(kv_blocks=1000, kv_block_size=16))]
    model.update(req(100), cands)  # the base
    for _ in range(32):
        model.placed("a", req(1000))
    # 8 more were still running: counted by the prefix-cache queries, not by the histogram.
    state["a"] = Scrape(104 * 3000, LatencyTotals(prompt_sum=96 * 3000.0, prompt_count=96))
    for _ in range(32):
        model.update(req(100), cands)
    assert abs(model.ratio - 3.0) < 1e-9
    assert sent["a"] == int(1000 * 16 / (64 * 3.0))
    assert model.stats.measured == {"per_request": 1} and model.stats.ratio == model.ratio


def test_without_the_engines_request_histogram_the_totals_fallback_is_said(caplog):
    # An engine that exports token totals but no request_prompt_tokens histogram: the ratio
    # comes from totals, which is right for one replica and wrong for several: a warning
    # (once) and the measurement's source on /metrics say so.
    sent: dict[str, int] = {}
    queries = {"a": 0}
    model = CapacityModel(sent.__setitem__, lambda addr: Scrape(queries[addr]))
    cands = [Candidate(Endpoint("a"), EndpointState(kv_blocks=1000, kv_block_size=16))]
    model.update(req(100), cands)
    for _ in range(32):
        model.placed("a", req(1000))
    queries["a"] += 64_000
    with caplog.at_level("WARNING", logger="extproc.index.capacity"):
        for _ in range(64):
            model.update(req(100), cands)
    assert abs(model.ratio - 2.0) < 1e-9
    assert model.stats.measured == {"totals": 2}
    assert [r.message for r in caplog.records].count(
        "KV capacity measured from token totals: the engines do not export "
        "request_prompt_tokens, so with several picker replicas each server is credited "
        "with only this replica's share of its cache"
    ) == 1


def test_a_ratio_never_measured_is_not_carried_over():
    # Calibration changed 4 -> 1 bytes per token before this replica placed enough to
    # measure: 1.0 is the prior, not a measurement; carried over as 0.25 it credited every
    # server with 4x its cache.
    sent: dict[str, int] = {}
    model = CapacityModel(sent.__setitem__, lambda addr: Scrape(0))
    cands = [Candidate(Endpoint("a"), EndpointState(kv_blocks=1000, kv_block_size=16))]
    model.update(req(100), cands)
    model.units_changed(4.0)
    assert model.ratio == 1.0 and not model.stats.measured
    model.update(req(100), cands)
    assert sent["a"] == 1000 * 16 // 64


def test_peers_placements_make_the_measurement_as_early_as_one_replicas():
    # Pooled (state.shared_calibration): this replica placed 8 of the 32 requests, its peers
    # the other 24. Both the tokens (20,000 estimated needed) and the recompute every 32
    # placements are there at this replica's next decision; alone it waited for 32 of its
    # own decisions and 20,000 of its own estimated tokens.
    sent: dict[str, int] = {}
    state = {"a": Scrape(0, LatencyTotals())}
    model = CapacityModel(sent.__setitem__, lambda addr: state[addr])
    alone = CapacityModel({}.__setitem__, lambda addr: state[addr])
    cands = [Candidate(Endpoint("a"), EndpointState(kv_blocks=1000, kv_block_size=16))]
    for m in (model, alone):
        m.update(req(100), cands)  # the base
        for _ in range(8):
            m.placed("a", req(1000))
            m.update(req(1000), cands)
    for _ in range(24):
        model.peer_placed("a", 1000)
    state["a"] = Scrape(96_000, LatencyTotals(prompt_sum=96_000.0, prompt_count=32))
    for m in (model, alone):
        m.update(req(100), cands)
    assert abs(model.ratio - 3.0) < 1e-9 and model.stats.measured == {"per_request": 1}
    assert sent["a"] == int(1000 * 16 / (64 * 3.0))
    assert alone.ratio == 1.0 and not alone.stats.measured


def test_first_min_tokens_measures_a_replicas_share_at_its_first_requests():
    # One of three replicas, uncalibrated: 5 of its placements (800 estimated tokens each,
    # 2,400 real) and 15 requests the engine finished. By default nothing is measured (4,000
    # estimated tokens, under 20,000; and only at every 32nd decision): the 1.0 prior credits
    # the server with 3x its cache. With `first_min_tokens` the next decision measures 3.0.
    def run(first: int | None) -> tuple[CapacityModel, dict[str, int]]:
        sent: dict[str, int] = {}
        state = {"a": Scrape(0, LatencyTotals())}
        model = CapacityModel(sent.__setitem__, lambda addr: state[addr], first_min_tokens=first)
        cands = [Candidate(Endpoint("a"), EndpointState(kv_blocks=400, kv_block_size=16))]
        model.update(req(100), cands)  # the base
        for _ in range(5):
            model.placed("a", req(800))
        state["a"] = Scrape(15 * 2400, LatencyTotals(prompt_sum=15 * 2400.0, prompt_count=15))
        model.update(req(100), cands)
        return model, sent

    default, sent = run(None)
    assert default.ratio == 1.0 and not default.stats.measured
    assert sent["a"] == 400 * 16 // 64
    early, sent = run(4000)
    assert abs(early.ratio - 3.0) < 1e-9 and early.stats.measured == {"per_request": 1}
    assert sent["a"] == int(400 * 16 / (64 * 3.0))
    # Fewer than 4,000 estimated tokens, or under 4 requests placed: not yet.
    assert run(5000)[0].ratio == 1.0


def test_first_min_tokens_waits_for_four_finished_requests():
    sent: dict[str, int] = {}
    state = {"a": Scrape(0, LatencyTotals())}
    model = CapacityModel(sent.__setitem__, lambda addr: state[addr], first_min_tokens=1000)
    cands = [Candidate(Endpoint("a"), EndpointState(kv_blocks=400, kv_block_size=16))]
    model.update(req(100), cands)
    for _ in range(6):
        model.placed("a", req(800))
    # Three finished: one prompt's size is not a mean yet.
    state["a"] = Scrape(3 * 2400, LatencyTotals(prompt_sum=3 * 2400.0, prompt_count=3))
    model.update(req(100), cands)
    assert model.ratio == 1.0
    state["a"] = Scrape(4 * 2400, LatencyTotals(prompt_sum=4 * 2400.0, prompt_count=4))
    model.update(req(100), cands)
    assert abs(model.ratio - 3.0) < 1e-9


def test_a_peers_pooled_placement_makes_the_first_measurement_early():
    # Three replicas pooling calibration (the default with a Redis index): 2 of this
    # replica's placements and 3 of its peers' (800 estimated tokens each, 2,400 real), 5
    # requests the engine counted. At 4,000 estimated tokens the next decision measures 3.0
    # (without first_min_tokens); a lone replica with the same placements of its own keeps
    # the 1.0 prior until 20,000 (early on one replica lost: thirteenth session).
    def run(peers: int) -> CapacityModel:
        state = {"a": Scrape(0, LatencyTotals())}
        model = CapacityModel({}.__setitem__, lambda addr: state[addr])
        cands = [Candidate(Endpoint("a"), EndpointState(kv_blocks=400, kv_block_size=16))]
        model.update(req(100), cands)  # the base
        for _ in range(5 - peers):
            model.placed("a", req(800))
            model.update(req(800), cands)
        for _ in range(peers):
            model.peer_placed("a", 800)
        state["a"] = Scrape(5 * 2400, LatencyTotals(prompt_sum=5 * 2400.0, prompt_count=5))
        model.update(req(100), cands)
        return model

    pooled = run(3)
    assert abs(pooled.ratio - 3.0) < 1e-9 and pooled.stats.measured == {"per_request": 1}
    alone = run(0)
    assert alone.ratio == 1.0 and not alone.stats.measured
