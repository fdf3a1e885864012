"""llm-d `flowControl` / `saturationDetector` sections: accepted, defaulted, errors located."""

from __future__ import annotations

import textwrap

import pytest

from extproc.config import build_configured_flow_control, decode_settings, load_settings
from extproc.errors import ConfigError
from extproc.flowcontrol.config import parse_duration, parse_quantity

EPP = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: max-score-picker
- name: conc
  type: concurrency-detector
  parameters: {maxConcurrency: 8, concurrencyMode: hybrid}
- type: round-robin-fairness-policy
- type: edf-ordering-policy
flowControl:
  maxRequests: 1k
  maxBytes: 1Gi
  defaultRequestTTL: 30s
  priorityBands:
  - priority: 10
    maxRequests: "100"
    fairnessPolicyRef: round-robin-fairness-policy
    orderingPolicyRef: edf-ordering-policy
  saturationDetector:
    pluginRef: conc
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""


def test_llm_d_config_with_flow_control_loads(tmp_path):
    p = tmp_path / "epp.yaml"
    p.write_text(EPP)
    s = load_settings(p)
    cfg = build_configured_flow_control(s)
    assert cfg is not None
    assert (cfg.max_requests, cfg.max_bytes, cfg.ttl_s) == (1000, 1 << 30, 30.0)
    assert type(cfg.detector).type_name == "concurrency-detector"
    assert cfg.detector.params.maxConcurrency == 8
    limits, ordering, fairness = cfg.band(10)
    assert limits.max_requests == 100
    assert type(ordering).type_name == "edf-ordering-policy"
    assert type(fairness).type_name == "round-robin-fairness-policy"


def test_off_by_default():
    assert build_configured_flow_control(decode_settings({})) is None
    assert build_configured_flow_control(decode_settings({"flow_control": {}})) is not None


def test_legacy_top_level_saturation_detector():
    doc = {
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": "max-score-picker"}, {"type": "concurrency-detector"}],
        "saturationDetector": {"pluginRef": "concurrency-detector"},
        "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "max-score-picker"}]}],
    }
    cfg = build_configured_flow_control(decode_settings(doc))
    assert type(cfg.detector).type_name == "concurrency-detector"


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ("    pluginRef: conc", "    pluginRef: nope"),
        ("  defaultRequestTTL: 30s", "  defaultRequestTTL: soon"),
        ("  maxRequests: 1k", "  maxRequests: lots"),
        ("    orderingPolicyRef: edf-ordering-policy", "    orderingPolicyRef: conc"),
        ("  maxBytes: 1Gi", "  maxBites: 1Gi"),
    ],
)
def test_bad_sections_name_the_field(tmp_path, change, where):
    p = tmp_path / "epp.yaml"
    p.write_text(EPP.replace(change, where))
    with pytest.raises(ConfigError) as err:
        load_settings(p)
    assert "flowControl" in str(err.value)


def test_detector_parameters_are_strict(tmp_path):
    p = tmp_path / "epp.yaml"
    p.write_text(EPP.replace("maxConcurrency: 8", "maxConcurency: 8"))
    with pytest.raises(ConfigError, match="parameters"):
        load_settings(p)


def test_durations_and_quantities():
    assert parse_duration("1m30s") == 90.0
    assert parse_duration("200ms") == pytest.approx(0.2)
    assert parse_quantity("5k") == 5000 and parse_quantity("1Mi") == 1 << 20
    assert parse_quantity(None) == 0
    for bad in ("", "5 s", "-1s"):
        with pytest.raises(ConfigError):
            parse_duration(bad)


def test_objectives_file(tmp_path):
    from extproc.flowcontrol.objectives import Objectives

    p = tmp_path / "obj.yaml"
    p.write_text(
        textwrap.dedent(
            """\
            apiVersion: inference.networking.x-k8s.io/v1alpha2
            kind: InferenceObjective
            metadata: {name: critical}
            spec: {priority: 10, poolRef: {name: pool}}
            ---
            kind: InferenceObjective
            metadata: {name: batch}
            spec: {priority: -1}
            """
        )
    )
    o = Objectives(str(p))
    assert o.priority({"x-llm-d-inference-objective": "critical"}) == 10
    assert o.priority({"x-gateway-inference-objective": "batch"}) == -1
    assert o.priority({"x-llm-d-inference-objective": "unknown"}) == 0
    assert o.priority({}) == 0
    p.write_text("{broken: [")
    import os

    os.utime(p, (1, 1))
    o.refresh()
    assert o.load_errors == 1 and o.table["critical"] == 10
    o.refresh()  # the reload tick, a second later: the same bad version is not said again
    assert o.load_errors == 1
    p.unlink()  # a new fault: missing
    o.refresh()
    o.refresh()
    assert o.load_errors == 2 and o.table["critical"] == 10


async def test_an_unreadable_objectives_file_shows_on_metrics(tmp_path):
    from prometheus_client import CollectorRegistry

    from extproc.flowcontrol.admission import Admission
    from extproc.flowcontrol.config import build_flow_config
    from extproc.flowcontrol.objectives import Objectives

    p = tmp_path / "obj.yaml"
    p.write_text("critical: 10\n")
    adm = Admission(
        build_flow_config({}, None, []), list, objectives=Objectives(str(p)),
        registry=CollectorRegistry(),
    )  # fmt: skip

    def errors() -> float:
        fam = next(f for f in adm.collect() if f.name == "extproc_flow_objectives_load_errors")
        return fam.samples[0].value

    try:
        assert errors() == 0
        p.unlink()
        adm.objectives.refresh()
        assert errors() == 1 and adm.objectives.table == {"critical": 10}
    finally:
        await adm.aclose()


def test_a_profile_cannot_use_a_flow_control_plugin(tmp_path):
    p = tmp_path / "epp.yaml"
    p.write_text(EPP.replace("  - pluginRef: queue-scorer\n", "  - pluginRef: conc\n"))
    with pytest.raises(ConfigError, match="flow-control plugin, not a scheduling one"):
        load_settings(p)
