"""The predicted-latency plugin family on crafted candidates: llm-d's chart config loads as
is, the scorer prefers the lowest predicted latency (or the SLO's packing order), the tier
filter keeps endpoints that meet the SLO, the admitter sheds only what llm-d sheds, and the
affinity gate breaks stickiness on predicted TTFT with no throughput configured."""

from __future__ import annotations

import dataclasses
import random
import textwrap

import pytest

from extproc.config import build_configured_scheduler, load_settings
from extproc.core import Decision, Endpoint
from extproc.errors import ConfigError, Overloaded
from extproc.latency import LatencyModel
from extproc.scheduling.plugins.latency import (
    LatencyScorer,
    LatencySloAdmitter,
    PredictedLatencyProducer,
    SloHeadroomTierFilter,
    slo_ms,
)
from extproc.scheduling.plugins.prefix import PrefixCacheAffinityFilter
from extproc.scheduling.registry import PluginRegistry
from tests.latency.synthetic import Engine, teach
from tests.scheduling.helpers import addrs, cand
from tests.scheduling.helpers import req as _req


def req(*, blocks: int = 0, tokens: int = 0, headers=None):
    """A request whose `blocks` block keys cover its `tokens` evenly."""
    r = _req(blocks=blocks, tokens=tokens, headers=headers)
    return dataclasses.replace(r, block_tokens=tokens // blocks) if blocks else r


# llm-d's chart (config/charts/routerlib/templates/_config.yaml), latency predictor enabled.
LLMD_LATENCY = textwrap.dedent(
    """\
    apiVersion: llm-d.ai/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: predicted-latency-producer
    - name: strict-affinity-filter
      type: prefix-cache-affinity-filter
      parameters:
        affinityThreshold: 0.99
        ttftSource: latencyPredictor
        maxTTFTPenaltyMs: 5000
    - name: loose-affinity-filter
      type: prefix-cache-affinity-filter
      parameters:
        affinityThreshold: 0.80
        ttftSource: latencyPredictor
        maxTTFTPenaltyMs: 5000
    - type: latency-scorer
    - type: weighted-random-picker
    - type: slo-headroom-tier-filter
    - type: latency-slo-admitter
    schedulingProfiles:
    - name: default
      plugins:
      - pluginRef: predicted-latency-producer
      - pluginRef: strict-affinity-filter
      - pluginRef: slo-headroom-tier-filter
      - pluginRef: loose-affinity-filter
      - pluginRef: latency-scorer
      - pluginRef: weighted-random-picker
    """
)

FAST = Engine(per_token_s=0.0001)  # 10,000 tokens/s
SLOW = Engine(per_token_s=0.0004)  # 2,500 tokens/s


def producer(**params) -> PredictedLatencyProducer:
    """A producer whose model learned a fast endpoint `f` and a slow one `s`."""
    p = PredictedLatencyProducer(PredictedLatencyProducer.Params(**params), model=LatencyModel())
    teach(p.model, "f", Engine(per_token_s=FAST.per_token_s))
    teach(p.model, "s", Engine(per_token_s=SLOW.per_token_s))
    return p


def bound(plugin, prod: PredictedLatencyProducer):
    plugin.bind({"predicted-latency-producer": prod})
    return plugin


def test_llm_d_latency_chart_config_loads_and_binds(tmp_path):
    path = tmp_path / "epp.yaml"
    path.write_text(LLMD_LATENCY)
    scheduler = build_configured_scheduler(load_settings(path))
    (profile,) = scheduler.profiles.values()
    assert [f.name for f in profile.filters] == [
        "predicted-latency-producer",
        "strict-affinity-filter",
        "slo-headroom-tier-filter",
        "loose-affinity-filter",
    ]
    assert [s.name for s in profile.scorers] == ["latency-scorer"]
    # Nothing is learned yet: the scorer falls back to load, the request is still routed.
    cands = [cand("a", waiting=3), cand("b", waiting=0)]
    decision = scheduler.schedule(req(tokens=100), cands)
    assert decision.endpoints
    assert any(isinstance(p, LatencySloAdmitter) for p in scheduler.plugins)


def test_llm_d_spellings_of_acronym_parameters_are_accepted():
    """llm-d writes `contextTTL` and `compositeKVWeight`: camel renaming alone would have
    made them `contextTtl` / `compositeKvWeight`, and an llm-d config a config error."""
    registry = PluginRegistry.default()
    prod = registry.build("predicted-latency-producer", {"contextTTL": "2m"}, ())
    assert prod.params.context_ttl == "2m"
    scorer = registry.build("latency-scorer", {"compositeKVWeight": 2.5}, ())
    assert scorer.params.composite_kv_weight == 2.5
    with pytest.raises(ConfigError, match="unknown field"):
        registry.build("latency-scorer", {"compositeKvWeight": 2.5}, ())


def test_newer_llm_d_producer_naming_its_prefix_producer_is_accepted():
    """llm-d's newer predicted-latency-producer names the prefix producer it reads; here the
    match comes from the shared index, so the parameter is accepted, not a config error."""
    registry = PluginRegistry.default()
    params = {"prefixMatchInfoProducerName": "precise-prefix-cache-producer"}
    prod = registry.build("predicted-latency-producer", params, ())
    assert prod.params.prefix_match_info_producer_name == "precise-prefix-cache-producer"


def test_latency_consumer_without_a_producer_is_a_config_error(tmp_path):
    path = tmp_path / "epp.yaml"
    path.write_text(
        "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: latency-scorer\n"
        "schedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: latency-scorer\n"
    )
    with pytest.raises(ConfigError, match="needs exactly one predicted-latency-producer"):
        build_configured_scheduler(load_settings(path))


def test_scorer_prefers_the_lowest_predicted_ttft_without_slo():
    prod = producer()
    scorer = bound(LatencyScorer(), prod)
    r = req(tokens=2000)
    scores = scorer.score(r, [cand("s"), cand("f")])
    assert scores[1] == 1.0 and scores[0] == 0.0
    # Queued work on the fast endpoint (placed by this picker) flips the order.
    for _ in range(10):
        prod.model.place("f", 3000, prod.model.now())
    r2 = req(tokens=2000)
    scores = scorer.score(r2, [cand("s"), cand("f")])
    assert scores[0] == 1.0 and scores[1] == 0.0


def test_scorer_counts_prefix_hits_as_less_prefill():
    prod = producer()
    scorer = bound(LatencyScorer(), prod)
    # 4,000 tokens: the slow endpoint holds 90% of them, the fast one nothing.
    r = req(blocks=10, tokens=4000)
    infos = prod.predictions(r, [cand("s", prefix=9.0), cand("f")])
    assert infos[0] is not None and infos[1] is not None
    assert infos[0].prediction.ttft_ms < infos[1].prediction.ttft_ms
    assert scorer.score(r, [cand("s", prefix=9.0), cand("f")]) == [1.0, 0.0]


def test_scorer_counts_the_wait_a_prefill_adds_to_the_requests_queued_behind_it():
    """Both endpoints are busy; the fast one holds the prompt's prefix, the slow one would
    prefill all of it and is predicted a little sooner. By TTFT alone the request goes to
    the slow one as a miss: 1.6 s of prefill that everyone queued behind it there waits for.
    Counting that wait (its prefill times the queue it finds), the hit on the busy cache
    holder wins, while an idle slow endpoint (nobody behind it) still wins on TTFT."""
    prod = producer()
    now = prod.model.now()
    for _ in range(6):
        prod.model.place("f", 3000, now)  # 6 x 0.3 s queued on the fast endpoint
    r = req(blocks=10, tokens=4000)
    cands = [cand("s"), cand("f", prefix=9.0)]
    ttft_s, ttft_f = (i.prediction.ttft_s for i in prod.predictions(r, cands))  # type: ignore[union-attr]
    assert ttft_s < ttft_f  # the idle slow endpoint is sooner
    assert bound(LatencyScorer(), prod).score(r, cands) == [1.0, 0.0]
    prod.model.place("s", 400, now)  # now the slow endpoint has a queue too
    r2 = req(blocks=10, tokens=4000)
    infos = prod.predictions(r2, cands)
    assert infos[0] is not None and infos[1] is not None
    assert infos[0].prediction.ttft_s < infos[1].prediction.ttft_s  # still sooner there
    assert (infos[0].prediction.queued, infos[1].prediction.queued) == (1, 6)
    assert bound(LatencyScorer(), prod).score(r2, cands) == [0.0, 1.0]
    ttft_only = LatencyScorer(LatencyScorer.Params(queue_cost=False))
    assert bound(ttft_only, prod).score(r2, cands) == [1.0, 0.0]


def test_scorer_with_slo_packs_onto_the_endpoint_closest_to_it_or_takes_most_headroom():
    prod = producer()
    r = req(tokens=1000, headers={"x-llm-d-slo-ttft-ms": "1000"})
    cands = [cand("s"), cand("f")]
    f, s = prod.predictions(r, cands)[1], prod.predictions(r, cands)[0]
    assert f is not None and s is not None and f.meets_slo and s.meets_slo
    assert bound(LatencyScorer(), prod).score(r, cands) == [1.0, 0.0]  # least headroom
    most = LatencyScorer(LatencyScorer.Params(headroom_selection_strategy="most"))
    assert bound(most, prod).score(r, cands) == [0.0, 1.0]


def test_scorer_scores_only_endpoints_meeting_the_slo_then_idle_ones():
    prod = producer()
    scorer = bound(LatencyScorer(), prod)
    # 2,000 tokens: fast ~0.2 s, slow ~0.8 s; SLO 500 ms.
    r = req(tokens=2000, headers={"x-slo-ttft-ms": "500"})
    assert scorer.score(r, [cand("s"), cand("f", running=3, waiting=0)]) == [0.0, 1.0]
    # Nobody meets 50 ms: the idle endpoint wins over the faster busy one.
    r = req(tokens=2000, headers={"x-llm-d-slo-ttft-ms": "50"})
    got = scorer.score(r, [cand("s", running=0), cand("f", running=5, inflight_requests=2)])
    assert got == [1.0, 0.0]


def test_scorer_falls_back_to_load_when_nothing_is_learned():
    prod = PredictedLatencyProducer(model=LatencyModel())
    scorer = bound(LatencyScorer(), prod)
    got = scorer.score(req(tokens=10), [cand("a", waiting=5, kv_usage=0.9), cand("b")])
    assert got[1] > got[0] and scorer.fallbacks == 1


def test_tpot_counts_in_streaming_mode_only_and_never_on_prefill_endpoints():
    # TTFT easy, 1 ms per token unmeetable.
    r = req(tokens=100, headers={"x-llm-d-slo-tpot-ms": "1", "x-llm-d-slo-ttft-ms": "9000"})
    (info,) = producer().predictions(r, [cand("f")])
    assert info is not None and info.tpot_neutral and info.meets_slo
    prod = producer(streaming_mode=True, endpoint_role_label="llm-d.ai/role")
    infos = prod.predictions(r, [cand("f"), cand("s", role="prefill")])
    assert infos[0] is not None and not infos[0].meets_slo and infos[0].tpot_headroom_ms < 0
    assert infos[1] is not None and infos[1].tpot_neutral and infos[1].meets_slo


def test_tier_filter_keeps_endpoints_meeting_the_slo_and_explores_rarely():
    prod = producer()
    r = req(tokens=2000, headers={"x-llm-d-slo-ttft-ms": "500"})
    cands = [cand("s"), cand("f")]
    filt = bound(SloHeadroomTierFilter(rng=random.Random(1)), prod)
    assert addrs(filt.filter(r, cands)) == ["f"]
    explore = SloHeadroomTierFilter(
        SloHeadroomTierFilter.Params(epsilon_explore_neg=1.0), rng=random.Random(1)
    )
    assert addrs(bound(explore, prod).filter(r, cands)) == ["s"]
    # No SLO: everyone is in the negative tier, nothing is removed.
    assert addrs(filt.filter(req(tokens=2000), cands)) == ["s", "f"]


def test_admitter_sheds_only_sheddable_requests_with_an_slo_nobody_can_meet():
    prod = producer()
    adm = bound(
        LatencySloAdmitter(LatencySloAdmitter.Params(objective_priorities={"batch": -1})), prod
    )
    busy = [cand("s", running=4, kv_usage=0.5), cand("f", running=4, kv_usage=0.5)]
    tight = {"x-llm-d-slo-ttft-ms": "10", "x-llm-d-inference-objective": "batch"}
    with pytest.raises(Overloaded):
        adm.admit(req(tokens=2000, headers=tight), busy)
    assert adm.shed == 1
    # Priority >= 0, no SLO, an SLO someone meets, an idle or cold endpoint: admitted.
    adm.admit(req(tokens=2000, headers={"x-llm-d-slo-ttft-ms": "10"}), busy)
    adm.admit(req(tokens=2000, headers={"x-llm-d-inference-objective": "batch"}), busy)
    loose = dict(tight, **{"x-llm-d-slo-ttft-ms": "5000"})
    adm.admit(req(tokens=2000, headers=loose), busy)
    adm.admit(req(tokens=2000, headers=tight), [busy[0], cand("f", running=0, kv_usage=0.5)])
    adm.admit(req(tokens=2000, headers=tight), [busy[0], cand("f", running=3, kv_usage=0.01)])
    assert adm.shed == 1


def test_admitter_in_a_scheduler_raises_overloaded_before_any_profile(tmp_path):
    path = tmp_path / "epp.yaml"
    path.write_text(
        LLMD_LATENCY.replace(
            "- type: latency-slo-admitter",
            "- type: latency-slo-admitter\n  parameters: {defaultPriority: -1}",
        )
    )
    scheduler = build_configured_scheduler(load_settings(path))
    prod = next(p for p in scheduler.plugins if isinstance(p, PredictedLatencyProducer))
    teach(prod.model, "a", Engine())
    busy = [cand("a", running=2, kv_usage=0.5)]
    with pytest.raises(Overloaded):
        scheduler.schedule(req(tokens=3000, headers={"x-llm-d-slo-ttft-ms": "1"}), busy)
    assert scheduler.schedule(req(tokens=3000), busy).endpoints


def test_affinity_gate_on_predicted_ttft_needs_no_throughput():
    """The sticky endpoint is the slow one: with a small penalty allowed the gate breaks
    stickiness, because the predictor knows it is slow; nobody set a throughput."""
    prod = producer()
    params = PrefixCacheAffinityFilter.Params(max_ttft_penalty_ms=100.0,
                                              ttft_source="latencyPredictor")  # fmt: skip
    gate = bound(PrefixCacheAffinityFilter(params), prod)
    r = req(blocks=10, tokens=8000)
    # The slow one holds 80%: 1,600 tokens at 2,500/s = 0.64 s; the fast one 8,000 at
    # 10,000/s = 0.8 s: stay.
    assert addrs(gate.filter(r, [cand("s", prefix=8.0), cand("f")])) == ["s"]
    # Queue 10 x 3,000 tokens on the slow one (12 s): go to the fast one.
    for _ in range(10):
        prod.model.place("s", 3000, prod.model.now())
    r = req(blocks=10, tokens=8000)
    assert addrs(gate.filter(r, [cand("s", prefix=8.0), cand("f")])) == ["f"]
    # Nothing learned: the gate cannot judge, stickiness holds (and is counted).
    blind = bound(PrefixCacheAffinityFilter(params), PredictedLatencyProducer(model=LatencyModel()))
    assert addrs(blind.filter(r, [cand("s", prefix=8.0), cand("f")])) == ["s"]
    assert blind.unjudged == 1


def test_producer_places_the_pick_and_returns_its_prediction_when_asked():
    prod = producer(response_header=True)
    r = req(tokens=1000)
    cands = [cand("f"), cand("s")]
    prod.filter(r, cands)
    decision = Decision(endpoints=(Endpoint("f"),))
    headers = prod.response_headers(decision)
    (info,) = prod.predictions(r, cands[:1])
    assert info is not None
    assert headers == {"x-extproc-predicted-ttft-ms": f"{info.prediction.ttft_ms:.1f}"}
    prod.observe(r, cands, decision)
    r2 = req(tokens=1000)
    (after,) = prod.predictions(r2, cands[:1])
    assert after is not None and after.prediction.ttft_ms > info.prediction.ttft_ms
    assert producer().response_headers(decision) == {}  # off by default


@pytest.mark.parametrize(
    ("value", "want"), [("250", 250.0), ("1e3", 1000.0), ("-5", 0.0), ("nan", 0.0),
                        ("inf", 0.0), ("soon", 0.0), ("", 0.0)],
)  # fmt: skip
def test_slo_headers_ignore_what_is_not_a_positive_number(value, want):
    assert slo_ms({"x-llm-d-slo-ttft-ms": value}, ("x-llm-d-slo-ttft-ms",)) == want
