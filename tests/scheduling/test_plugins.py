"""Built-in plugins, one behaviour each."""

from __future__ import annotations

import random

import pytest

from extproc.core import Decision, Endpoint
from extproc.scheduling.plugins.affinity import (
    EncoderCacheScorer,
    SessionAffinityScorer,
    session_token,
)
from extproc.scheduling.plugins.filters import (
    DecodeFilter,
    EncodeFilter,
    LabelSelectorFilter,
    PrefillFilter,
)
from extproc.scheduling.plugins.pickers import MaxScorePicker, WeightedRandomPicker
from extproc.scheduling.plugins.prefix import (
    NoHitLRUScorer,
    PrefixCacheAffinityFilter,
    PrefixCacheScorer,
)
from extproc.scheduling.plugins.scorers import (
    ActiveRequestScorer,
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    LoraAffinityScorer,
    QueueScorer,
    TokenLoadScorer,
)
from tests.scheduling.helpers import addrs, cand, req


def test_queue_scorer_prefers_short_queues_and_distrusts_stale_figures():
    cands = [
        cand("a", waiting=0),
        cand("b", waiting=10),
        cand("c", waiting=5),
        cand("d", age_s=5.0),
    ]
    assert QueueScorer().score(req(), cands) == [1.0, 0.0, 0.5, 0.0]


def test_never_scraped_endpoint_scores_zero_on_metrics():
    assert KVCacheUtilizationScorer().score(req(), [cand("a", age_s=None)]) == [0.0]


def test_kv_cache_utilization_scorer_is_free_fraction():
    scores = KVCacheUtilizationScorer().score(
        req(), [cand("a", kv_usage=0.25), cand("b", kv_usage=1.0)]
    )
    assert scores == [0.75, 0.0]


def test_kv_left_after_the_request_does_not_penalise_the_prefix_holder():
    # A 6,400-token cache (400 blocks of 16); a 2,560-token prompt of 40 blocks. The holder
    # uses 60% (mostly the prefix this request shares) and holds 36 of its 40 blocks; the
    # cold server uses 20% and must write the whole prompt (40% of its cache).
    r = req(blocks=40, tokens=2560)
    size = {"kv_blocks": 400, "kv_block_size": 16}
    holder = cand("holder", prefix=36, kv_usage=0.6, **size)
    cold = cand("cold", kv_usage=0.2, **size)
    used = KVCacheUtilizationScorer().score(r, [holder, cold])
    assert used == pytest.approx([0.4, 0.8])  # the default: what is used now
    after = KVCacheUtilizationScorer(KVCacheUtilizationScorer.Params(count_request=True))
    # Left once placed: the holder writes 256 tokens (0.04), the cold server 2,560 (0.4).
    assert after.score(r, [holder, cold]) == pytest.approx([0.36, 0.4])
    # Unknown capacity: what is used now; a request past the free space scores 0; stale 0.
    assert after.score(r, [cand("x", kv_usage=0.3)]) == pytest.approx([0.7])
    assert after.score(r, [cand("y", kv_usage=0.7, **size)]) == [0.0]
    assert after.score(r, [cand("z", age_s=5.0, **size)]) == [0.0]


def test_active_request_and_token_load_scorers_prefer_less_placed_work():
    cands = [
        cand("a", inflight_requests=2, inflight_tokens=100),
        cand("b", inflight_requests=0, inflight_tokens=900),
    ]
    assert ActiveRequestScorer().score(req(), cands) == [0.0, 1.0]
    assert TokenLoadScorer().score(req(), cands) == [1.0, 0.0]


def test_token_load_scorer_explains_the_books_it_scored_on():
    # What a trace sets against the engine's own KV (bench/trace_kvwait.py).
    cands = [
        cand("a", inflight_requests=2, inflight_tokens=100, kv_usage=0.5, age_s=0.2),
        cand("b", age_s=None),
    ]
    a, b = TokenLoadScorer().explain(req(), cands)
    assert a["inflight_tokens"] == 100 and a["inflight_requests"] == 2
    assert a["kv_usage"] == 0.5 and a["age_s"] == 0.2
    assert b["age_s"] == -1.0  # never scraped


def test_load_aware_scorer_is_absolute():
    s = LoadAwareScorer(LoadAwareScorer.Params(threshold=10))
    assert s.score(req(), [cand("a"), cand("b", waiting=5), cand("c", waiting=50)]) == [
        1.0,
        0.5,
        0.0,
    ]


def test_lora_affinity_prefers_running_then_waiting_then_free_slot():
    cands = [
        cand("run", running_adapters=frozenset({"x"}), max_adapters=1),
        cand(
            "wait",
            waiting_adapters=frozenset({"x"}),
            running_adapters=frozenset({"y"}),
            max_adapters=1,
        ),
        cand("free", running_adapters=frozenset(), max_adapters=1),
        cand("full", running_adapters=frozenset({"y"}), max_adapters=1),
    ]
    assert LoraAffinityScorer().score(req(adapter="x"), cands) == [1.0, 0.8, 0.6, 0.0]
    assert LoraAffinityScorer().score(req(), cands) == [1.0] * 4


def test_prefix_cache_scorer_is_matched_fraction():
    cands = [cand("a", prefix=8), cand("b", prefix=2), cand("c")]
    assert PrefixCacheScorer().score(req(blocks=8), cands) == [1.0, 0.25, 0.0]
    assert PrefixCacheScorer().score(req(blocks=0), cands) == [0.0, 0.0, 0.0]


def test_affinity_filter_keeps_sticky_endpoints():
    f = PrefixCacheAffinityFilter()
    cands = [cand("hot", prefix=10), cand("cold1"), cand("cold2", prefix=2)]
    assert addrs(f.filter(req(blocks=10, tokens=640), cands)) == ["hot"]


def test_affinity_filter_lets_all_through_when_nobody_holds_enough():
    f = PrefixCacheAffinityFilter()
    cands = [cand("a", prefix=5), cand("b")]
    assert addrs(f.filter(req(blocks=10, tokens=640), cands)) == ["a", "b"]


def test_ttft_gate_breaks_stickiness_when_the_sticky_endpoint_is_swamped():
    f = PrefixCacheAffinityFilter(
        PrefixCacheAffinityFilter.Params(max_ttft_penalty_ms=1000, peak_prefill_throughput=1000)
    )
    calm = [cand("hot", prefix=10, inflight_tokens=500), cand("cold")]
    swamped = [cand("hot", prefix=10, inflight_tokens=5000), cand("cold")]
    r = req(blocks=10, tokens=640)
    assert addrs(f.filter(r, calm)) == ["hot"]
    assert addrs(f.filter(r, swamped)) == ["cold"]


def test_exploration_sometimes_lets_everything_through():
    f = PrefixCacheAffinityFilter(
        PrefixCacheAffinityFilter.Params(exploration_probability=0.5), rng=random.Random(1)
    )
    cands = [cand("hot", prefix=10), cand("cold")]
    sizes = [len(f.filter(req(blocks=10), cands)) for _ in range(200)]
    assert 50 < sizes.count(2) < 150


def test_no_hit_lru_spreads_cold_requests_and_ignores_warm_ones():
    s = NoHitLRUScorer()
    cands = [cand("a"), cand("b"), cand("c")]
    r = req(blocks=4)
    for _ in range(3):
        scores = s.score(r, cands)
        best = max(range(3), key=lambda i: scores[i])
        s.observe(r, cands, Decision(endpoints=(cands[best].endpoint,)))
    # Each cold request went somewhere not used before.
    assert sorted(s._recent) == ["a", "b", "c"]
    scores = s.score(r, cands)
    assert scores[addrs(cands).index(next(iter(s._recent)))] == max(scores)
    warm = [cand("a", prefix=1), cand("b"), cand("c")]
    assert s.score(r, warm) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(("record", "recorded"), [("endpoints", []), ("scored", ["c"])])
def test_no_hit_lru_records_a_pick_new_only_on_the_scored_candidates_if_asked(record, recorded):
    # "a" holds the tenants' shared header; a filter removed it, so the request is new on
    # the candidates scored (b, c) but not on every endpoint, which the router observes with.
    s = NoHitLRUScorer(NoHitLRUScorer.Params(record_cold=record))
    every = [cand("a", prefix=1), cand("b"), cand("c")]
    r = req(blocks=4)
    assert s.score(r, every[1:]) == [1.0, 1.0]
    s.observe(r, every, Decision(endpoints=(every[2].endpoint,)))
    assert list(s._recent) == recorded
    # Only the request just scored counts: another one placed after is judged on `every`.
    s.observe(req(blocks=4), every, Decision(endpoints=(every[1].endpoint,)))
    assert list(s._recent) == recorded


def test_session_affinity_follows_the_token_it_issued():
    s = SessionAffinityScorer()
    headers = s.response_headers(Decision(endpoints=(Endpoint("10.0.0.2:8000"),)))
    token = headers["x-session-token"]
    assert token == session_token("10.0.0.2:8000")
    cands = [cand("10.0.0.1:8000"), cand("10.0.0.2:8000")]
    assert s.score(req(headers={"x-session-token": token}), cands) == [0.0, 1.0]
    assert s.score(req(headers={"x-session-token": "%%%"}), cands) == [0.0, 0.0]
    assert s.score(req(), cands) == [0.0, 0.0]


def test_encoder_cache_scorer_remembers_where_media_went():
    s = EncoderCacheScorer(EncoderCacheScorer.Params(capacity=2))
    cands = [cand("a"), cand("b")]
    r = req(media=("img1", "img2"))
    assert s.score(r, cands) == [0.0, 0.0]
    s.observe(r, cands, Decision(endpoints=(cands[1].endpoint,)))
    assert s.score(r, cands) == [0.0, 1.0]
    assert s.score(req(media=("img1", "other")), cands) == [0.0, 0.5]
    s.observe(req(media=("x", "y")), cands, Decision(endpoints=(cands[1].endpoint,)))
    assert s.score(r, cands) == [0.0, 0.0]  # evicted: capacity 2
    assert s.score(req(), cands) == [1.0, 1.0]


def test_role_filters():
    cands = [
        cand("u"),
        cand("d", role="decode"),
        cand("p", role="prefill"),
        cand("e", role="encode"),
        cand("pd", role="prefill-decode"),
        cand("epd", role="encode-prefill-decode"),
    ]
    assert addrs(DecodeFilter().filter(req(), cands)) == ["u", "d", "pd", "epd"]
    assert addrs(PrefillFilter().filter(req(), cands)) == ["p", "pd", "epd"]
    assert addrs(EncodeFilter().filter(req(), cands)) == ["e", "epd"]


def test_label_selector_filter():
    f = LabelSelectorFilter(LabelSelectorFilter.Params(match_labels={"gpu": "h100"}))
    cands = [cand("a", labels={"gpu": "h100"}), cand("b", labels={"gpu": "a10"}), cand("c")]
    assert addrs(f.filter(req(), cands)) == ["a"]


def test_max_score_picker_orders_by_score_and_spreads_ties():
    p = MaxScorePicker(rng=random.Random(0))
    cands = [cand("a"), cand("b"), cand("c")]
    assert addrs(p.pick(cands, [0.1, 0.9, 0.5], 3)) == ["b", "c", "a"]
    firsts = {addrs(p.pick(cands, [1.0, 1.0, 0.0], 1))[0] for _ in range(50)}
    assert firsts == {"a", "b"}


def test_weighted_random_picker_follows_weights():
    p = WeightedRandomPicker(rng=random.Random(0))
    cands = [cand("a"), cand("b"), cand("z")]
    firsts = [addrs(p.pick(cands, [3.0, 1.0, 0.0], 1))[0] for _ in range(2000)]
    assert firsts.count("z") == 0
    assert 0.65 < firsts.count("a") / 2000 < 0.85


@pytest.mark.parametrize(
    "plugin", [QueueScorer(), KVCacheUtilizationScorer(), ActiveRequestScorer()]
)
def test_scores_stay_in_unit_range(plugin):
    cands = [cand(str(i), waiting=i * 3, kv_usage=i / 10, inflight_requests=i) for i in range(8)]
    assert all(0.0 <= s <= 1.0 for s in plugin.score(req(), cands))


def test_extproc_plugins_prints_each_plugins_parameters_from_its_params(capsys):
    """`extproc plugins` says it lists the parameters: they are read from each Params, so a
    new parameter is printed without anyone remembering to."""
    from extproc.cli import main
    from extproc.scheduling.registry import PluginRegistry

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    registry = PluginRegistry.default()
    blocks = {b.split("\n", 1)[0]: b for b in out.split("\n\n") if b}
    for name in registry.type_names:
        line = next(ln for ln in blocks[name].splitlines() if "parameters (default):" in ln)
        assert all(f" {key} " in line + " " for key, _ in registry.parameters(name)), name
    assert "epsilon 0.25" in blocks["bounded-load-filter"]
    assert "label required" in blocks["by-label"]
    assert "parameters (default): none" in blocks["queue-scorer"]
