"""The llm-d edge (extproc.scheduling.llmd): every section and field it translates, every
problem reported in one run with file:line and "did you mean", realisation reported."""

from __future__ import annotations

import textwrap
from pathlib import Path

import msgspec
import pytest

from extproc.cli import main
from extproc.config import decode_settings, examine, find_tokenizer, load_settings
from extproc.errors import ConfigError
from extproc.scheduling.llmd.table import PENDING_TYPES
from extproc.scheduling.llmd.translate import translate
from extproc.scheduling.plugins import BUILTINS
from extproc.scheduling.registry import PluginRegistry

BASE = textwrap.dedent(
    """\
    apiVersion: llm-d.ai/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: queue-scorer
    - type: max-score-picker
    schedulingProfiles:
    - name: default
      plugins:
      - pluginRef: queue-scorer
      - pluginRef: max-score-picker
    """
)


def doc(extra: str = "", base: str = BASE) -> dict:
    import yaml

    return yaml.safe_load(base + extra)


def problems(d: dict) -> list[str]:
    return [str(p) for p in examine(d).problems]


@pytest.mark.parametrize(
    "api", ["llm-d.ai/v1alpha1", "llm-d.ai/v1", "inference.networking.x-k8s.io/v1alpha1"]
)
def test_both_api_groups_and_versions_are_accepted(api):
    d = doc()
    d["apiVersion"] = api
    assert problems(d) == []


def test_an_unknown_api_version_is_refused_with_a_suggestion():
    d = doc()
    d["apiVersion"] = "llm-d.ai/v1alpha2"
    (p,) = problems(d)
    assert "unsupported apiVersion" in p and "did you mean 'llm-d.ai/v1alpha1'" in p


def test_every_problem_is_reported_in_one_run_with_lines_and_suggestions(tmp_path, capsys):
    text = textwrap.dedent(
        """\
        apiVersion: llm-d.ai/v1alpha1
        kind: EndpointPickerConfig
        plugins:
        - type: queue-scorr
        - type: prefix-cache-affinity-filter
          parameters:
            affinityTreshold: 0.6
        - type: max-score-picker
        schedulingProfile:
        - name: x
        schedulingProfiles:
        - name: default
          plugins:
          - pluginRef: queue-scorer
          - pluginRef: max-score-pickr
        """
    )
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "5 problem(s)" in err  # the fifth: the profile's ref to the misspelt plugin
    assert (
        f"{path}:4: plugins[0].type: unknown plugin type 'queue-scorr' "
        "(did you mean 'queue-scorer'?)" in err
    )
    assert (
        f"{path}:7: plugins[1].parameters.affinityTreshold: unknown field "
        "(did you mean 'affinityThreshold'?)" in err
    )
    assert f"{path}:9: schedulingProfile: unknown field (did you mean 'schedulingProfiles'?)" in err
    assert (
        f"{path}:15: schedulingProfiles[0].plugins[1].pluginRef: no plugin named "
        "'max-score-pickr' (did you mean 'max-score-picker'?)" in err
    )


def test_the_multimodal_posts_retuned_gate_loads_in_llm_ds_spelling():
    """issue 12's headline: affinityThreshold, maxTTFTPenaltyMs, peakPrefillThroughput."""
    d = doc()
    params = {"affinityThreshold": 0.6, "maxTTFTPenaltyMs": 36000, "peakPrefillThroughput": 20000}
    d["plugins"].append({"type": "prefix-cache-affinity-filter", "parameters": params})
    d["schedulingProfiles"][0]["plugins"].insert(0, {"pluginRef": "prefix-cache-affinity-filter"})
    settings = decode_settings(d)
    assert settings.scheduling is not None
    assert settings.scheduling.plugins[-1].parameters == params


def test_extprocs_older_parameter_names_are_translated_and_said_so():
    registry = PluginRegistry.default()
    d = doc()
    d["plugins"].append(
        {
            "type": "prefix-cache-affinity-filter",
            "parameters": {"threshold": 0.6, "peakPrefillTokensPerSecond": 9000},
        }
    )
    t = translate(d, registry)
    assert t.problems == []
    spec = next(s for s in t.config.plugins if s.type == "prefix-cache-affinity-filter")
    assert spec.parameters == {"affinityThreshold": 0.6, "peakPrefillThroughput": 9000}
    (r,) = [r for r in t.realised if r.type == "prefix-cache-affinity-filter"]
    assert any("older name for llm-d's affinityThreshold" in n for n in r.notes)


def test_ignored_parameters_are_said_so():
    registry = PluginRegistry.default()
    d = doc()
    d["plugins"][0] = {"type": "prefix-cache-scorer", "parameters": {"mode": "precise"}}
    d["schedulingProfiles"][0]["plugins"][0] = {"pluginRef": "prefix-cache-scorer"}
    t = translate(d, registry)
    assert t.problems == []
    (r,) = [r for r in t.realised if r.type == "prefix-cache-scorer"]
    assert any(n.startswith("parameter mode ignored: the keys are precise") for n in r.notes)


def test_every_ignored_parameter_is_one_its_plugin_accepts():
    """IGNORED_PARAMS names only (type, parameter) pairs the type's plugin really accepts
    (its Params, scheduling or flow control's): a note for a parameter the plugin would
    refuse as an unknown field could never be printed, and means the table drifted from
    llm-d's parameter structs."""
    from extproc.flowcontrol.config import FLOW_PLUGINS
    from extproc.scheduling.llmd.table import IGNORED_PARAMS

    registry = PluginRegistry(BUILTINS)
    params = {t: registry.get(t).Params for t in registry.type_names}
    params.update({c.type_name: c.Params for c in FLOW_PLUGINS})
    drifted = [
        (t, p)
        for t, p in IGNORED_PARAMS
        if t not in params or p not in {f.encode_name for f in msgspec.structs.fields(params[t])}
    ]
    assert drifted == []


def test_every_mapped_ignored_parameter_is_one_its_type_accepts():
    """A mapped type's `ignored` reasons name only parameters its Params decodes: a reason
    for a parameter the type refuses as an unknown field could never be printed, and means
    the table drifted from llm-d's parameter structs."""
    from extproc.scheduling.llmd.mapped import MAPPED

    pairs = [(t, p) for t, m in MAPPED.items() for p in m.ignored]
    accepted = {
        t: {f.encode_name for f in msgspec.structs.fields(m.params)} for t, m in MAPPED.items()
    }
    assert len(pairs) > 20  # the table is really read
    assert [(t, p) for t, p in pairs if p not in accepted[t]] == []


@pytest.mark.parametrize(
    ("value", "noted"),
    [(None, False), (False, False), ({}, False), ([], False), ("", True), (0, True), ([{}], True)],
)
def test_null_false_and_empty_collections_are_not_set(value, noted):
    from extproc.scheduling.llmd.ignored import is_set

    assert is_set(value) is noted


@pytest.mark.parametrize(
    ("type_name", "param", "value", "noted"),
    [
        # scheduling types (IGNORED_PARAMS)
        ("session-affinity-scorer", "sessionIdConfig", {}, False),
        ("session-affinity-scorer", "sessionIdConfig", None, False),
        ("session-affinity-scorer", "sessionIdConfig", {"headerName": "x-sid"}, True),
        ("predicted-latency-producer", "useEncoderCacheFeatures", False, False),
        ("predicted-latency-producer", "useEncoderCacheFeatures", True, True),
        ("random-picker", "maxNumOfEndpoints", 0, True),
        # mapped plumbing types (MappedType.ignored)
        ("core-metrics-extractor", "engineConfigs", [], False),
        ("core-metrics-extractor", "engineConfigs", [{"name": "vllm"}], True),
        ("inflight-load-producer", "syncCrossReplicaState", False, False),
        ("inflight-load-producer", "syncCrossReplicaState", True, True),
        ("k8s-notification-source", "group", "", True),
        ("k8s-notification-source", "group", None, False),
    ],
)
def test_scheduling_and_mapped_types_note_by_the_same_rule(type_name, param, value, noted):
    """Both paths that say "parameter X ignored" (IGNORED_PARAMS for scheduling and
    flow-control types, MappedType.ignored for plumbing) decide "set" by `is_set`."""
    d = doc()
    d["plugins"].append({"type": type_name, "parameters": {param: value}})
    t = translate(d, PluginRegistry.default())
    assert t.problems == []
    (r,) = [r for r in t.realised if r.type == type_name]
    said = any(n.startswith(f"parameter {param} ignored: ") for n in r.notes)
    assert said is noted


def test_llm_d_deprecated_disagg_parameters_are_translated():
    d = doc()
    d["plugins"] += [
        {
            "type": "disagg-profile-handler",
            "parameters": {"prefillDeciderPluginName": "dec", "decodeProfile": "default"},
        },
        {"type": "always-disagg-pd-decider", "name": "dec"},
    ]
    t = translate(d, PluginRegistry.default())
    assert t.problems == []
    spec = next(s for s in t.config.plugins if s.type == "disagg-profile-handler")
    assert spec.parameters == {"deciders": {"prefill": "dec"}, "profiles": {"decode": "default"}}


def test_sections_are_decoded_and_their_plugin_refs_checked():
    d = doc()
    d["plugins"] += [
        {"type": "openai-parser"},
        {"type": "metrics-data-source"},
        {"type": "core-metrics-extractor"},
    ]
    d["requestHandler"] = {"parsers": [{"pluginRef": "openai-parser"}]}
    d["parser"] = {"pluginRef": "openai-parser"}
    d["dataLayer"] = {
        "sources": [
            {
                "pluginRef": "metrics-data-source",
                "extractors": [{"pluginRef": "core-metrics-extractor"}],
            }
        ]
    }
    d["featureGates"] = ["dataLayer", "enableLegacyMetrics"]
    assert problems(d) == []
    d["dataLayer"]["sources"][0]["extractors"][0]["pluginRef"] = "core-metrics-extractr"
    d["requestHandler"]["parsers"][0]["pluginRef"] = "openai"
    got = problems(d)
    assert len(got) == 2
    assert any("extractors[0].pluginRef: no plugin named 'core-metrics-extractr'" in p for p in got)
    assert any("parsers[0].pluginRef: no plugin named 'openai'" in p for p in got)
    d["dataLayer"]["sorces"] = []
    assert any(
        "dataLayer.sorces: unknown field (did you mean 'sources'?)" in p for p in problems(d)
    )
    del d["dataLayer"]["sorces"]
    d["dataLayer"]["crossReplicaSyncerPluginRef"] = "local-syncr"
    assert any(
        "dataLayer.crossReplicaSyncerPluginRef: no plugin named 'local-syncr'" in p
        for p in problems(d)
    )


def test_flow_control_types_and_sections_go_to_flow_control():
    d = doc()
    d["plugins"].append({"type": "utilization-detector", "parameters": {"queueDepthThreshold": 9}})
    d["flowControl"] = {"saturationDetector": {"pluginRef": "utilization-detector"}}
    ex = examine(d)
    assert ex.problems == [] and ex.settings is not None
    assert ex.settings.scheduling is not None
    assert ex.settings.scheduling.flowControl == d["flowControl"]  # raw, for flow control
    (r,) = [r for r in ex.translation.realised if r.type == "utilization-detector"]
    assert r.how.startswith("implemented by flow control")
    d["flowControl"]["saturationDetector"]["pluginRef"] = "utilisation-detector"
    assert any("no plugin named 'utilisation-detector'" in p for p in problems(d))


def test_flow_control_eviction_and_late_policies_are_implemented():
    d = doc()
    d["plugins"] += [
        {"type": t}
        for t in (
            "sheddable-eviction-filter",
            "priority-then-time-eviction-order-policy",
            "eviction-sheddable-filter",
            "eviction-priority-then-time-ordering",
        )
    ]
    d["flowControl"] = {"enableEviction": True}
    assert problems(d) == []
    d = doc()
    d["plugins"] += [{"type": "program-aware-fairness"}, {"type": "soft-reflective-ceiling-policy"}]
    assert problems(d) == []


def test_predicted_latency_plugins_are_implemented_and_the_gie_name_pending():
    d = doc()
    d["plugins"] += [
        {"type": "predicted-latency-producer"},
        {"type": "prefix-cache-affinity-filter", "parameters": {"ttftSource": "latencyPredictor"}},
    ]
    t = translate(d, PluginRegistry.default())
    assert t.problems == []
    d["plugins"].append({"type": "predicted-latency-scorer"})
    (p,) = problems(d)
    assert "'predicted-latency-scorer' is pending: built in issue 16" in p


def test_a_registered_plugin_takes_precedence_over_the_pending_table():
    """When issue 15/16 register a real plugin, the table entry is simply shadowed."""

    class HeaderRouter:
        type_name = "slo-aware-profile-handler"

        class Params(msgspec.Struct, forbid_unknown_fields=True):
            horizon: int = 5

        def __init__(self, params):
            pass

        def handle(self, req, cands, profiles, run):
            return run(profiles[0])

    assert "slo-aware-profile-handler" in PENDING_TYPES
    registry = PluginRegistry([*BUILTINS, HeaderRouter])
    d = doc()
    d["plugins"].append({"type": "slo-aware-profile-handler", "parameters": {"horizon": 9}})
    t = translate(d, registry)
    assert t.problems == []
    assert [r.kind for r in t.realised if r.type == "slo-aware-profile-handler"] == ["implemented"]


def test_mapped_plugins_turn_on_extprocs_machinery(tmp_path):
    d = doc()
    d["plugins"] += [
        {
            "type": "approx-prefix-cache-producer",
            "parameters": {
                "blockSizeTokens": 32,
                "maxPrefixBlocksToMatch": 100,
                "lruCapacityPerServer": 777,
            },
        },
        {
            "type": "metrics-data-source",
            "parameters": {"scheme": "https", "path": "/m", "interval": "250ms"},
        },
    ]
    s = examine(d).settings
    assert s is not None
    assert (s.parse.block_tokens, s.parse.max_blocks) == (32, 100)
    assert s.index.capacity_blocks == 777 and s.index.record_decisions is True
    assert s.state.scrape is not None
    assert (s.state.scrape.scheme, s.state.scrape.path, s.state.scrape.interval_s) == (
        "https",
        "/m",
        0.25,
    )


def test_speculative_ttl_alone_is_said_to_have_no_effect():
    from extproc.scheduling.llmd.mapped import MAPPED, PreciseProducerParams

    effect = MAPPED["precise-prefix-cache-producer"].effect
    assert effect is not None
    _, notes = effect(PreciseProducerParams(speculativeTTL="2s"))
    assert any(n.startswith("speculativeIndexing / speculativeTTL:") for n in notes)


@pytest.mark.parametrize(
    ("parameters", "verify", "ca_file"),
    [
        ({}, False, None),
        ({"insecureSkipVerify": True}, False, None),
        ({"insecureSkipVerify": False, "caCertPath": "/etc/ca.pem"}, True, "/etc/ca.pem"),
    ],
)
def test_tls_verification_follows_insecure_skip_verify(parameters, verify, ca_file):
    # llm-d's default is not to verify; asking for verification must not be dropped.
    d = doc()
    d["plugins"] += [
        {"type": "metrics-data-source", "parameters": {"scheme": "https", **parameters}},
        {"type": "dcgm-data-source", "parameters": {"scheme": "https", **parameters}},
    ]
    d["plugins"][-1]["parameters"].pop("caCertPath", None)  # not a dcgm-data-source field
    ex = examine(d)
    s = ex.settings
    assert s is not None and s.state.scrape is not None and s.state.dcgm is not None
    assert (s.state.scrape.tls_verify, s.state.scrape.tls_ca_file) == (verify, ca_file)
    assert s.state.dcgm.tls_verify is verify
    assert ex.translation is not None
    notes = [n for r in ex.translation.realised for n in r.notes]
    assert not [n for n in notes if "insecureSkipVerify" in n or "caCertPath" in n]


def test_mapped_plugin_parameters_are_strict():
    d = doc()
    d["plugins"].append({"type": "metrics-data-source", "parameters": {"intervall": "1s"}})
    (p,) = problems(d)
    assert "parameters.intervall: unknown field (did you mean 'interval'?)" in p


def test_token_producer_finds_a_local_tokenizer_by_model_name(tmp_path):
    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_text("{}")
    assert find_tokenizer("org/tiny", [str(tmp_path)]) == snap
    assert find_tokenizer("org/other", [str(tmp_path)]) is None
    (tmp_path / "org" / "other").mkdir(parents=True)
    (tmp_path / "org" / "other" / "tokenizer.json").write_text("{}")
    assert find_tokenizer("org/other", [str(tmp_path)]) == tmp_path / "org" / "other"


def test_precise_producer_with_a_local_tokenizer_turns_on_kv_events(tmp_path):
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    (tmp_path / "org" / "tiny" / "tokenizer.json").write_text("{}")
    d = doc()
    d["plugins"] += [
        {"type": "token-producer", "parameters": {"modelName": "org/tiny"}},
        {
            "type": "precise-prefix-cache-producer",
            "parameters": {
                "tokenProcessorConfig": {"blockSize": 64},
                "kvEventsConfig": {"zmqEndpoint": "tcp://*:5999"},
            },
        },
    ]
    ex = examine({"tokenizer_dirs": [str(tmp_path)], "scheduling": d})
    s = ex.settings
    assert s is not None and ex.degraded == []
    assert s.parse.precise is not None
    assert (s.parse.precise.model, s.parse.precise.block_size) == ("org/tiny", 64)
    assert s.index.kv_events is not None and s.index.kv_events.bind == "tcp://*:5999"


def test_load_settings_names_every_problem_with_its_line(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        BASE.replace("queue-scorer\n- type", "queue-scorr\n- type").replace(
            "- pluginRef: max-score-picker", "- pluginRef: max-score-picker\n    weight: -1"
        )
    )
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    lines = str(e.value).splitlines()
    assert len(lines) == 3, lines  # the type, the ref to it, the weight
    assert all(line.startswith(f"{path}:") for line in lines)


def test_check_config_prints_how_each_plugin_is_realised(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(
        BASE
        + "- type: token-producer\n  parameters: {modelName: x/y, vllm: {url: http://v:8000}}\n"
    )
    # plugins list is the last key of BASE's plugins? No: append to plugins explicitly.
    d = doc()
    d["plugins"].append(
        {"type": "token-producer", "parameters": {"modelName": "x/y", "vllm": {"url": "http://v"}}}
    )
    import yaml

    path.write_text(yaml.safe_dump(d, sort_keys=False))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "queue-scorer: implemented" in out
    assert "token-producer: mapped to the precise tokenizer" in out
    assert "parameter vllm ignored: extproc tokenizes in-process" in out
    assert "profile default:" in out


def test_check_config_notes_parameters_accepted_without_effect(tmp_path, capsys):
    """Parameters check-config used to accept silently though they do nothing: flow
    control's (through its own path), mapped plugins' and sections' each get a note."""
    import yaml

    d = doc()
    d["plugins"] += [
        {
            "type": "concurrency-detector",
            "parameters": {"inFlightLoadProducerName": "inflight-load-producer", "headroom": 0.2},
        },
        {"type": "utilization-detector", "parameters": {"headroom": 0.1}},
        {
            "type": "k8s-notification-source",
            "parameters": {"group": "", "version": "v1", "kind": "Pod"},
        },
        {"type": "session-id-producer", "parameters": {"headerName": "x-sid", "cookieName": "sid"}},
        {"type": "inflight-load-producer", "parameters": {"prefixMatchInfoProducerName": "p"}},
        {
            "type": "predicted-latency-producer",
            "parameters": {
                "inFlightLoadProducerName": "i",
                "samplingMean": 200,
                "contextTTL": "1m",
            },
        },
        {"type": "prefix-cache-scorer", "name": "old-prefix", "parameters": {"autoTune": True}},
    ]
    d["flowControl"] = {
        "saturationDetector": {"pluginRef": "concurrency-detector"},
        "noEndpointRequestTTL": "5s",
    }
    d["dataLayer"] = {"injectDefaults": False, "crossReplicaSyncInterval": "1s"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    expected = {
        "concurrency-detector": [
            "parameter inFlightLoadProducerName ignored: in-flight counts are the picker's own",
            "parameter headroom ignored: it sets llm-d's per-endpoint routing limit",
        ],
        "utilization-detector": ["parameter headroom ignored:"],
        "k8s-notification-source": [
            f"parameter {p} ignored: extproc's discovery watches the InferencePool's endpoints"
            for p in ("group", "version", "kind")
        ],
        "session-id-producer": [
            f"parameter {p} ignored: nothing reads the session ID"
            for p in ("headerName", "cookieName")
        ],
        "inflight-load-producer": [
            "parameter prefixMatchInfoProducerName ignored: the uncached prompt tokens come"
        ],
        "predicted-latency-producer": [
            "parameter inFlightLoadProducerName ignored:",
            "parameter samplingMean ignored: deprecated and unused in llm-d too",
            "parameter contextTTL ignored: extproc keeps no per-request context",
        ],
        "old-prefix (prefix-cache-scorer)": ["parameter autoTune ignored: the block size comes"],
    }
    # Each plugin's notes are the "    - " lines under its "  label: how" line.
    blocks: dict[str, list[str]] = {}
    label = ""
    for line in out.splitlines():
        if line.startswith("  ") and not line.startswith("    ") and ": " in line:
            label = line.strip().split(": ", 1)[0]
            blocks[label] = []
        elif line.startswith("    - "):
            blocks[label].append(line[6:])
    for label, wanted in expected.items():
        for w in wanted:
            assert any(n.startswith(w) for n in blocks[label]), (label, w, blocks.get(label))
    assert "note: flowControl.noEndpointRequestTTL ignored: not implemented" in out
    assert "note: dataLayer.injectDefaults: false ignored: extproc scrapes" in out
    assert "note: dataLayer.crossReplicaSyncInterval: state.shared_inflight.interval_s = 1 s" in out


def test_cross_replica_sync_interval_becomes_the_in_flight_exchange_interval():
    """llm-d's dataLayer.crossReplicaSyncInterval (a Go duration) sets
    state.shared_inflight.interval_s unless our own section sets it or turns sharing off."""
    d = doc()
    d["dataLayer"] = {"crossReplicaSyncInterval": "250ms"}
    ex = examine(d)
    assert ex.problems == [] and ex.settings is not None
    assert ex.settings.state.shared_inflight is not None
    assert ex.settings.state.shared_inflight.interval_s == 0.25
    assert ex.settings.state.shared_inflight.effective_ttl_s == 3 * 0.25 + 0.5
    assert any(
        n.startswith(
            "dataLayer.crossReplicaSyncInterval: state.shared_inflight.interval_s = 0.25 s"
        )
        for n in ex.notes
    )

    ours = examine({"state": {"shared_inflight": {"interval_s": 0.1}}, "scheduling": d})
    assert ours.settings is not None and ours.settings.state.shared_inflight is not None
    assert ours.settings.state.shared_inflight.interval_s == 0.1
    assert (
        "dataLayer.crossReplicaSyncInterval ignored: state.shared_inflight.interval_s is set "
        "(0.1 s)" in ours.notes
    )

    off = examine({"state": {"shared_inflight": None}, "scheduling": d})
    assert off.settings is not None and off.settings.state.shared_inflight is None
    assert any("state.shared_inflight is null" in n for n in off.notes)

    d["dataLayer"] = {"crossReplicaSyncInterval": "250"}
    assert problems(d) == [
        "scheduling.dataLayer.crossReplicaSyncInterval: not a duration: '250' (e.g. '50ms', '1s')"
    ]
    d["dataLayer"] = {"crossReplicaSyncInterval": "0s"}
    assert problems(d) == ["scheduling.dataLayer.crossReplicaSyncInterval: must be positive"]


def test_docs_compatibility_table_lists_every_llm_d_type():
    from extproc.scheduling.llmd.mapped import MAPPED
    from extproc.scheduling.llmd.table import LLMD_TYPES

    text = (Path(__file__).resolve().parents[2] / "docs" / "llm-d.md").read_text()
    for t in sorted(LLMD_TYPES | set(MAPPED)):
        assert f"`{t}`" in text, t


def test_our_own_document_reports_its_problems_and_the_scheduling_ones_together(tmp_path):
    import yaml

    d = {"server": {"colour": "red"}, "scheduling": doc()}
    d["scheduling"]["plugins"][0]["type"] = "queue-scorr"
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_settings(path)
    text = str(e.value)
    assert "server.colour: unknown field" in text
    assert "scheduling.plugins[0].type: unknown plugin type 'queue-scorr'" in text
