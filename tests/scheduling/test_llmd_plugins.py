"""llm-d's scheduling plugins, implemented with llm-d's semantics, on crafted candidates."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from extproc.config import build_configured_scheduler, decode_settings
from extproc.errors import ConfigError
from extproc.scheduling.handlers import ENCODERS_HEADER, PREFILLER_HEADER
from extproc.scheduling.plugins.affinity import (
    HeaderLabelAffinityScorer,
    SessionAffinityFilter,
    session_token,
)
from extproc.scheduling.plugins.context_length import ContextLengthAware, range_score
from extproc.scheduling.plugins.deciders import (
    AlwaysDisaggMultimodalDecider,
    AlwaysDisaggPDDecider,
    PrefixBasedPDDecider,
)
from extproc.scheduling.plugins.filters import ByLabelFilter, LabelSelectorFilter
from extproc.scheduling.plugins.profile_handlers import DATA_PARALLEL_HEADER
from extproc.scheduling.plugins.topology import TopologyAffinityFilter, TopologyAffinityScorer
from extproc.scheduling.plugins.utilization import RunningRequestsSizeScorer, UtilizationFilter
from tests.scheduling.helpers import addrs, cand, req


def scheduler(text: str):
    return build_configured_scheduler(decode_settings(yaml.safe_load(textwrap.dedent(text))))


# -- deciders -----------------------------------------------------------------------------


def test_prefix_based_decider_counts_tokens_the_decode_pick_does_not_hold():
    d = PrefixBasedPDDecider(PrefixBasedPDDecider.Params(non_cached_tokens=100))
    r = req(blocks=4, tokens=256)  # 64 tokens per block
    assert d.disaggregate(r, cand("a", prefix=0)) is True  # 256 uncached
    assert d.disaggregate(r, cand("a", prefix=1)) is True  # 256 - 64 = 192
    assert d.disaggregate(r, cand("a", prefix=2.5)) is False  # 256 - 160 = 96
    assert d.disaggregate(r, cand("a", prefix=3)) is False  # 64 uncached
    assert d.disaggregate(req(tokens=50), cand("a")) is False  # prompt shorter than 100


def test_prefix_based_decider_is_off_by_default_and_honours_prompt_tokens():
    assert PrefixBasedPDDecider().disaggregate(req(tokens=10_000), cand("a")) is False
    d = PrefixBasedPDDecider(PrefixBasedPDDecider.Params(non_cached_tokens=10, prompt_tokens=500))
    assert d.disaggregate(req(tokens=400), cand("a")) is False
    assert d.disaggregate(req(tokens=600), cand("a")) is True


def test_always_deciders():
    assert AlwaysDisaggPDDecider().disaggregate(req(tokens=1), cand("a")) is True
    mm = AlwaysDisaggMultimodalDecider()
    assert mm.disaggregate(req(media=("img",)), cand("a")) is True
    assert mm.disaggregate(req(tokens=5000), cand("a")) is False


# -- profile handlers ---------------------------------------------------------------------

PD_FLEET = [
    cand("10.0.0.1:8000", role="decode"),
    cand("10.0.1.1:8000", role="prefill"),
    cand("10.0.2.1:8000", role="encode"),
]

DISAGG = """\
kind: EndpointPickerConfig
plugins:
- type: disagg-profile-handler
  parameters: {stageOrder: STAGE, deciders: {prefill: always-disagg-pd-decider}}
- type: always-disagg-pd-decider
- type: decode-filter
- type: prefill-filter
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}]
- name: prefill
  plugins: [{pluginRef: prefill-filter}]
"""


@pytest.mark.parametrize("stage", ["decode-first", "prefill-first", "PrefillFirst"])
def test_disagg_stage_orders_both_give_decode_plus_prefiller(stage):
    d = scheduler(DISAGG.replace("STAGE", stage)).schedule(req(tokens=10), PD_FLEET)
    assert d.primary.address == "10.0.0.1:8000"
    assert d.headers == {PREFILLER_HEADER: "10.0.1.1:8000"}


def test_disagg_rejects_an_unknown_stage_order():
    with pytest.raises(ConfigError, match="stageOrder"):
        scheduler(DISAGG.replace("STAGE", "sideways"))


def test_data_parallel_handler_names_the_rank_and_enters_through_the_primary_port():
    s = scheduler(
        """\
        kind: EndpointPickerConfig
        plugins:
        - type: data-parallel-profile-handler
          parameters: {primaryPort: 8000}
        - type: queue-scorer
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: queue-scorer}]
        """
    )
    fleet = [cand("10.0.0.1:8001", waiting=5), cand("10.0.0.1:8002", waiting=0)]
    d = s.schedule(req(), fleet)
    assert d.primary.address == "10.0.0.1:8000"
    assert d.headers == {DATA_PARALLEL_HEADER: "10.0.0.1:8002"}


def test_pd_profile_handler_uses_its_named_decider():
    s = scheduler(
        """\
        kind: EndpointPickerConfig
        plugins:
        - type: pd-profile-handler
          parameters: {deciderPluginName: always}
        - type: always-disagg-pd-decider
          name: always
        - type: decode-filter
        - type: prefill-filter
        schedulingProfiles:
        - name: decode
          plugins: [{pluginRef: decode-filter}]
        - name: prefill
          plugins: [{pluginRef: prefill-filter}]
        """
    )
    d = s.schedule(req(tokens=10), PD_FLEET)
    assert d.headers == {PREFILLER_HEADER: "10.0.1.1:8000"}


def test_header_profile_handler_runs_the_profile_the_request_names():
    s = scheduler(
        """\
        kind: EndpointPickerConfig
        plugins:
        - type: header-profile-handler
        - type: decode-filter
        - type: encode-filter
        schedulingProfiles:
        - name: decode
          plugins: [{pluginRef: decode-filter}]
        - name: encode
          plugins: [{pluginRef: encode-filter}]
        """
    )
    assert s.schedule(req(), PD_FLEET).primary.address == "10.0.0.1:8000"
    asked = s.schedule(req(headers={"epp-profile": "encode"}), PD_FLEET)
    assert asked.primary.address == "10.0.2.1:8000"
    assert s.schedule(req(headers={"epp-profile": "nope"}), PD_FLEET).endpoints == ()


def test_encode_decider_gives_encoders_only_to_media_requests():
    s = scheduler(
        DISAGG.replace("STAGE", "decode-first")
        .replace(
            "{prefill: always-disagg-pd-decider}", "{encode: always-disagg-multimodal-decider}"
        )
        .replace(
            "- type: always-disagg-pd-decider",
            "- type: always-disagg-multimodal-decider\n- type: encode-filter",
        )
        + "- name: encode\n  plugins: [{pluginRef: encode-filter}]\n"
    )
    assert s.schedule(req(media=("i",)), PD_FLEET).headers == {ENCODERS_HEADER: "10.0.2.1:8000"}
    assert s.schedule(req(tokens=5000), PD_FLEET).headers == {}


# -- filters and scorers ------------------------------------------------------------------


def test_session_affinity_filter_keeps_only_the_sessions_endpoint_when_present():
    f = SessionAffinityFilter()
    fleet = [cand("a:1"), cand("b:1")]
    assert addrs(f.filter(req(headers={"x-session-token": session_token("b:1")}), fleet)) == ["b:1"]
    assert addrs(f.filter(req(headers={"x-session-token": session_token("gone:1")}), fleet)) == [
        "a:1",
        "b:1",
    ]
    assert addrs(f.filter(req(), fleet)) == ["a:1", "b:1"]


def test_session_id_strategy_is_refused_as_not_implemented():
    with pytest.raises(ConfigError, match="session_id is not implemented"):
        scheduler(
            """\
            kind: EndpointPickerConfig
            plugins:
            - type: session-affinity-filter
              parameters: {strategy: session_id}
            schedulingProfiles:
            - name: default
              plugins: [{pluginRef: session-affinity-filter}]
            """
        )


def test_header_label_affinity_scorer():
    s = HeaderLabelAffinityScorer(
        HeaderLabelAffinityScorer.Params(header_name="X-Tenant", label_key="tenant")
    )
    fleet = [cand("a", labels={"tenant": "t1"}), cand("b", labels={"tenant": "t2"}), cand("c")]
    assert s.score(req(headers={"x-tenant": "t2"}), fleet) == [0.0, 1.0, 0.0]
    assert s.score(req(), fleet) == [0.0, 0.0, 0.0]


def test_by_label_keeps_valid_values_and_optionally_unlabelled():
    f = ByLabelFilter(ByLabelFilter.Params(label="gpu", valid_values=["h100"]))
    fleet = [cand("a", labels={"gpu": "h100"}), cand("b", labels={"gpu": "l4"}), cand("c")]
    assert addrs(f.filter(req(), fleet)) == ["a"]
    g = ByLabelFilter(ByLabelFilter.Params(label="gpu", valid_values=["l4"], allows_no_label=True))
    assert addrs(g.filter(req(), fleet)) == ["b", "c"]


def test_label_selector_match_expressions():
    p = LabelSelectorFilter.Params(
        match_expressions=[
            {"key": "gpu", "operator": "In", "values": ["h100", "a100"]},  # type: ignore[list-item]
            {"key": "spot", "operator": "DoesNotExist"},  # type: ignore[list-item]
        ]
    )
    import msgspec

    p = msgspec.convert(msgspec.to_builtins(p), LabelSelectorFilter.Params)
    f = LabelSelectorFilter(p)
    fleet = [
        cand("a", labels={"gpu": "h100"}),
        cand("b", labels={"gpu": "a100", "spot": "1"}),
        cand("c", labels={"gpu": "l4"}),
    ]
    assert addrs(f.filter(req(), fleet)) == ["a"]


def test_context_length_aware_scores_the_best_fitting_range_and_can_filter():
    fleet = [
        cand("short", labels={"llm-d.ai/context-length-range": "0-2048"}),
        cand("long", labels={"llm-d.ai/context-length-range": "2048-32768"}),
        cand("any"),
        cand("bad", labels={"llm-d.ai/context-length-range": "lots"}),
    ]
    c = ContextLengthAware()
    short, long_, any_, bad = c.score(req(tokens=1000), fleet)
    assert short > 0.3 > long_ and any_ == 0.5 and bad == 0.0
    assert range_score(5000, 0, 2048) < 0.3
    f = ContextLengthAware(ContextLengthAware.Params(enable_filtering=True))
    assert addrs(f.filter(req(tokens=4000), fleet)) == ["long", "any"]
    assert addrs(c.filter(req(tokens=4000), fleet)) == addrs(fleet)  # filtering off


def test_context_length_aware_in_a_profile_is_filter_and_scorer():
    s = scheduler(
        """\
        kind: EndpointPickerConfig
        plugins:
        - type: context-length-aware
          parameters: {enableFiltering: true}
        schedulingProfiles:
        - name: default
          plugins: [{pluginRef: context-length-aware}]
        """
    )
    (profile,) = s.profiles.values()
    assert [f.name for f in profile.filters] == ["context-length-aware"]
    assert [w.name for w in profile.scorers] == ["context-length-aware"]


def test_utilization_filter_ceilings_and_fallback():
    import msgspec

    p = msgspec.convert(
        {"conditions": [{"metric": "waiting-queue", "maxValue": 4}]}, UtilizationFilter.Params
    )
    f = UtilizationFilter(p)
    fleet = [cand("a", waiting=2), cand("b", waiting=9)]
    assert addrs(f.filter(req(), fleet)) == ["a"]
    assert f.filter(req(), [cand("b", waiting=9)]) == []
    params = msgspec.convert(
        {
            "conditions": [{"metric": "kv-cache-utilization", "maxValue": 0.5}],
            "fallbackOnEmpty": True,
        },
        UtilizationFilter.Params,
    )
    g = UtilizationFilter(params)
    assert addrs(g.filter(req(), [cand("x", kv_usage=0.9)])) == ["x"]
    with pytest.raises(msgspec.ValidationError, match="fraction"):
        msgspec.convert(
            {"conditions": [{"metric": "kv-cache-utilization", "maxValue": 3}]},
            UtilizationFilter.Params,
        )


def test_running_requests_size_scorer_is_min_max_scaled():
    s = RunningRequestsSizeScorer()
    assert s.score(req(), [cand("a", running=2), cand("b", running=6), cand("c", running=4)]) == [
        1.0,
        0.0,
        0.5,
    ]
    assert s.score(req(), [cand("a", running=3), cand("b", running=3)]) == [1.0, 1.0]


TOPO = {
    "d": {"kubernetes.io/hostname": "h1", "topology.kubernetes.io/zone": "z1"},
    "same-host": {"kubernetes.io/hostname": "h1", "topology.kubernetes.io/zone": "z1"},
    "same-zone": {"kubernetes.io/hostname": "h2", "topology.kubernetes.io/zone": "z1"},
    "far": {"kubernetes.io/hostname": "h3", "topology.kubernetes.io/zone": "z9"},
}


def test_topology_scorer_and_filter_place_near_the_peer():
    import dataclasses

    fleet = [cand(n, labels=lab) for n, lab in TOPO.items() if n != "d"]
    peer = cand("d", labels=TOPO["d"]).endpoint
    r = dataclasses.replace(req(), peer=peer)
    assert TopologyAffinityScorer().score(r, fleet) == [1.0, 0.05, 0.0]
    assert TopologyAffinityScorer().score(req(), fleet) == [0.0, 0.0, 0.0]  # no peer
    host = TopologyAffinityFilter()
    assert addrs(host.filter(r, fleet)) == ["same-host"]
    zone = TopologyAffinityFilter(TopologyAffinityFilter.Params(min_affinity="zone"))
    assert addrs(zone.filter(r, fleet)) == ["same-host", "same-zone"]
    assert addrs(host.filter(r, fleet[2:])) == ["far"]  # nothing close: all kept


def test_topology_filter_in_a_pd_config_keeps_prefill_near_the_decode_pick():
    s = scheduler(
        """\
        kind: EndpointPickerConfig
        plugins:
        - type: disagg-profile-handler
          parameters: {deciders: {prefill: always-disagg-pd-decider}}
        - type: always-disagg-pd-decider
        - type: decode-filter
        - type: prefill-filter
        - type: topology-affinity-filter
          parameters: {minAffinity: zone}
        - type: topology-extractor
          parameters: {zone: my/zone}
        schedulingProfiles:
        - name: decode
          plugins: [{pluginRef: decode-filter}]
        - name: prefill
          plugins: [{pluginRef: prefill-filter}, {pluginRef: topology-affinity-filter}]
        """
    )
    fleet = [
        cand("d:1", role="decode", labels={"my/zone": "z1"}),
        cand("p-far:1", role="prefill", labels={"my/zone": "z2"}),
        cand("p-near:1", role="prefill", labels={"my/zone": "z1"}),
    ]
    for _ in range(10):
        assert s.schedule(req(tokens=10), fleet).headers == {PREFILLER_HEADER: "p-near:1"}


# -- GIE v0.5 chart defaults ----------------------------------------------------------------


def test_gie_least_filters_keep_the_lowest_band():
    from extproc.scheduling.plugins.gie_legacy import LeastKVCacheFilter, LeastQueueFilter

    fleet = [
        cand("a", waiting=0, kv_usage=0.1),
        cand("b", waiting=3, kv_usage=0.2),
        cand("c", waiting=9, kv_usage=0.9),
    ]
    assert addrs(LeastQueueFilter().filter(req(), fleet)) == ["a", "b"]  # <= 0 + 9 // 3
    assert addrs(LeastKVCacheFilter().filter(req(), fleet)) == ["a", "b"]  # <= 0.1 + 0.8 / 3


def test_gie_lora_affinity_filter_prefers_loaded_adapters_else_free_slots():
    import random

    from extproc.scheduling.plugins.gie_legacy import LoraAffinityFilter

    fleet = [
        cand("loaded", running_adapters=frozenset({"ad"}), max_adapters=2),
        cand("free", max_adapters=2),
        cand("full", running_adapters=frozenset({"x", "y"}), max_adapters=2),
    ]
    f = LoraAffinityFilter(rng=random.Random(1))
    assert addrs(f.filter(req(adapter="ad"), fleet)) == ["loaded"]
    never = LoraAffinityFilter(LoraAffinityFilter.Params(threshold=0.0))
    assert addrs(never.filter(req(adapter="ad"), fleet)) == ["free"]
    assert addrs(f.filter(req(adapter="new"), fleet)) == ["loaded", "free"]  # free slots


def test_gie_v05_chart_default_decision_tree_routes_to_the_least_loaded():
    """GIE v0.5's chart default: low-queue -> lora -> least-queue -> least-kv, as a tree."""
    from pathlib import Path

    path = (
        Path(__file__).resolve().parents[1]
        / "fixtures"
        / "llmd-configs"
        / "gie-v0.5.1--chart_default-plugins.yaml"
    )
    s = build_configured_scheduler(decode_settings(yaml.safe_load(path.read_text())))
    fleet = [
        cand("busy", waiting=200, kv_usage=0.1),
        cand("kv-full", waiting=1, kv_usage=0.95),
        cand("best", waiting=0, kv_usage=0.2),
    ]
    picks = {s.schedule(req(), fleet).primary.address for _ in range(20)}
    assert picks == {"best"}
    # Everyone over the low-queue threshold: the failure branch still picks the least loaded.
    swamped = [cand("x", waiting=300, kv_usage=0.5), cand("y", waiting=150, kv_usage=0.4)]
    assert {s.schedule(req(), swamped).primary.address for _ in range(20)} == {"y"}


def test_decision_tree_names_a_missing_filter():
    with pytest.raises(ConfigError, match="no plugin named 'nope'"):
        scheduler(
            """\
            kind: EndpointPickerConfig
            plugins:
            - type: decision-tree-filter
              parameters: {current: {pluginRef: nope}}
            schedulingProfiles:
            - name: default
              plugins: [{pluginRef: decision-tree-filter}]
            """
        )


# -- endpoint attributes (GPUUtilization from DCGM) ------------------------------------------


def test_endpoint_attribute_filter_threshold_missing_and_fallback():
    import msgspec

    from extproc.scheduling.plugins.attributes import EndpointAttributeFilter

    def build(**extra):
        params = {
            "attribute": "GPUUtilization",
            "algorithm": {
                "type": "threshold",
                "threshold": {"operator": "LessThanOrEqual", "value": 0.9},
            },
            **extra,
        }
        return EndpointAttributeFilter(msgspec.convert(params, EndpointAttributeFilter.Params))

    fleet = [
        cand("cool", attributes={"GPUUtilization": 0.3}),
        cand("hot", attributes={"GPUUtilization": 0.95}),
        cand("unknown"),
    ]
    assert addrs(build().filter(req(), fleet)) == ["cool", "unknown"]  # onMissing: Pass
    assert addrs(build(onMissing="Fail").filter(req(), fleet)) == ["cool"]
    hot = [fleet[1]]
    assert build().filter(req(), hot) == []
    assert addrs(build(fallbackOnEmpty=True).filter(req(), hot)) == ["hot"]


def test_endpoint_attribute_scorer_fixed_and_adaptive_ranges():
    import msgspec

    from extproc.scheduling.plugins.attributes import EndpointAttributeScorer

    def build(algorithm):
        params = {"attributeKey": "GPUUtilization", "algorithm": algorithm}
        return EndpointAttributeScorer(msgspec.convert(params, EndpointAttributeScorer.Params))

    fleet = [
        cand("a", attributes={"GPUUtilization": 0.2}),
        cand("b", attributes={"GPUUtilization": 0.6}),
        cand("c"),
    ]
    fixed = build(
        {
            "type": "linear_lower_is_better",
            "normalization": {"fixedRange": {"min": 0.0, "max": 1.0}},
        }
    )
    assert fixed.score(req(), fleet) == pytest.approx([0.8, 0.4, 0.0])
    adaptive = build({"type": "linear_higher_is_better"})
    assert adaptive.score(req(), fleet) == pytest.approx([0.0, 1.0, 0.0])
    with pytest.raises(msgspec.ValidationError, match="min must be below"):
        build(
            {
                "type": "linear_lower_is_better",
                "normalization": {"fixedRange": {"min": 1.0, "max": 1.0}},
            }
        )


def test_an_attribute_nothing_produces_is_a_config_error():
    from extproc.config import examine

    d = yaml.safe_load(
        textwrap.dedent(
            """\
            kind: EndpointPickerConfig
            plugins:
            - type: endpoint-attribute-filter
              parameters:
                attribute: GPUUtilisation
                algorithm: {type: threshold, threshold: {operator: LessThan, value: 0.5}}
            schedulingProfiles:
            - name: default
              plugins: [{pluginRef: endpoint-attribute-filter}]
            """
        )
    )
    (p,) = [str(x) for x in examine(d).problems]
    assert "no producer of attribute 'GPUUtilisation'" in p and "'GPUUtilization'" in p
    d["plugins"][0]["parameters"]["attribute"] = "GPUUtilization"
    (p,) = [str(x) for x in examine(d).problems]
    assert "needs a dcgm-data-source plugin" in p


def test_prefix_scorer_blends_in_the_match_length_when_asked():
    from extproc.scheduling.plugins.prefix import PrefixCacheScorer

    fleet = [cand("half", prefix=2), cand("none")]
    r = req(blocks=4)  # 64 tokens per block
    assert PrefixCacheScorer().score(r, fleet) == [0.5, 0.0]
    blended = PrefixCacheScorer(
        PrefixCacheScorer.Params(match_length_weight=0.5, match_length_scale_tokens=256)
    )
    # 0.5 * (128 / 256)^2 + 0.5 * 0.5
    assert blended.score(r, fleet) == pytest.approx([0.375, 0.0])
