"""Every file of the llm-d config corpus (tests/fixtures/llmd-configs) is accepted as it is,
or refused for exactly the reason it is expected to be: test-only plugins of llm-d's own
loader tests, and a CEL-based plugin extproc refuses. Every real config serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.config import (
    build_configured_flow_control,
    build_configured_scheduler,
    examine,
    load_settings,
)
from extproc.errors import ConfigError

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "llmd-configs"
FILES = sorted(p.name for p in CORPUS.glob("*.yaml"))

TEST_ONLY = "test-only plugin of llm-d's own loader"

# file -> substrings every one of which must appear among its problems (refused files).
REFUSED = {
    "gie-v1.5.0--test_integration_epp_testdata_datalayer-config.yaml": [TEST_ONLY],
    "gie-v1.5.0--test_testdata_configloader_1_test.yaml": [TEST_ONLY],
    "router--test_integration_epp_testdata_datalayer-config.yaml": [TEST_ONLY],
    "router--test_integration_epp_testdata_request-attribute-reporter-config.yaml": [
        TEST_ONLY,
        "request-attribute-reporter' refused: CEL expressions",
    ],
    "router--test_testdata_configloader_1_test.yaml": [TEST_ONLY],
}
# Precise-prefix configs whose tokenizer is not on this machine: served with approximate keys.
DEGRADED = {
    "router--deploy_config_epp-mm-embeddings-cache-config.yaml",
    "router--deploy_config_epp-precise-prefix-cache-config.yaml",
    "router--deploy_config_sim-epp-kvcache-config.yaml",
    "router--deploy_config_sim-epp-no-hit-lru.yaml",
    "router--deploy_config_sim-epp-tokenizer-vllm-http-config.yaml",
    "sched--deploy_config_epp-precise-prefix-cache-config.yaml",
    "sched--deploy_config_sim-epp-kvcache-config.yaml",
    "sched--deploy_config_sim-epp-no-hit-lru.yaml",
    "sched--deploy_config_sim-epp-tokenizer-vllm-http-config.yaml",
}


def test_the_corpus_is_all_here_and_comment_free():
    assert len(FILES) == 38  # 35 of the shared corpus + GIE's three chart defaults
    assert set(REFUSED) <= set(FILES) and set(FILES) >= DEGRADED
    for name in FILES:
        assert "#" not in (CORPUS / name).read_text(), name


@pytest.mark.parametrize("name", FILES)
def test_each_corpus_file_is_accepted_or_refused_for_its_reason(name, tmp_path):
    path = CORPUS / name
    if name in REFUSED:
        with pytest.raises(ConfigError) as e:
            load_settings(path)
        text = str(e.value)
        for reason in REFUSED[name]:
            assert reason in text
        # Every problem is located: file:line.
        for line in text.splitlines():
            assert line.startswith(f"{path}:"), line
        return
    # No local tokenizers: point the lookup at an empty folder so the outcome does not
    # depend on this machine's caches.
    doc = yaml.safe_load(path.read_text())
    ex = examine({"tokenizer_dirs": [str(tmp_path)], "scheduling": doc})
    assert ex.problems == []
    assert ex.settings is not None
    scheduler = build_configured_scheduler(ex.settings)
    assert scheduler.profiles
    assert bool(ex.degraded) == (name in DEGRADED)
    assert load_settings(path) is not None


def test_all_33_real_configs_load():
    real = [n for n in FILES if n not in REFUSED or TEST_ONLY not in REFUSED[n][0]]
    assert len(real) == 33  # 38 minus the 5 loader/integration test fixtures
    assert [n for n in real if n in REFUSED] == []


def test_the_last_two_flow_control_configs_build_their_policies():
    """The program-aware and soft-reflective-ceiling configs (refused until the policies
    were built) load, and flow control is built with those very policies."""
    from extproc.flowcontrol.policies import SoftReflectiveCeiling
    from extproc.flowcontrol.programs import ProgramAwareFairness

    fc = build_configured_flow_control(
        load_settings(CORPUS / "router--deploy_config_sim-program-aware-config.yaml")
    )
    assert fc is not None
    assert isinstance(fc.band(0)[2], ProgramAwareFairness)  # the default band's template
    assert isinstance(fc.band(7)[2], ProgramAwareFairness)
    fc = build_configured_flow_control(
        load_settings(CORPUS / "router--deploy_config_soft-reflective-ceiling-epp-config.yaml")
    )
    assert fc is not None
    assert isinstance(fc.usage_limit, SoftReflectiveCeiling)


def test_mangled_corpus_files_give_problems_never_crashes():
    """Random values swapped into real configs: every outcome is a list of problems (or a
    valid config), never an exception escaping the loader."""
    import copy
    import random

    docs = [yaml.safe_load((CORPUS / n).read_text()) for n in FILES]
    junk = [None, 1, "x", [], {}, [1, 2], {"a": 1}, -5, 1.5, True, {"pluginRef": 3}]
    rng = random.Random(12)

    def mutate(node, depth: int = 0) -> None:
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
            if rng.random() < 0.4 or depth > 4:
                node[key] = rng.choice(junk)
            else:
                mutate(node[key], depth + 1)
        elif isinstance(node, list) and node:
            i = rng.randrange(len(node))
            if rng.random() < 0.4 or depth > 4:
                node[i] = rng.choice(junk)
            else:
                mutate(node[i], depth + 1)

    for _ in range(150):
        d = copy.deepcopy(rng.choice(docs))
        for _ in range(rng.randint(1, 3)):
            mutate(d)
        ex = examine(d)
        assert ex.problems or ex.settings is not None


@pytest.mark.parametrize(
    ("name", "plugin", "note"),
    [
        (
            "router--deploy_config_sim-epp-no-hit-lru.yaml",
            "prefix-cache-scorer",
            "parameter prefixMatchInfoProducerName ignored: the prefix match comes from the one "
            "shared prefix index",
        ),
        (
            "router--deploy_config_epp-burst-prefix-cache-config.yaml",
            "prefix-cache-scorer",
            "parameter prefixMatchInfoProducerName ignored:",
        ),
        (
            "router--deploy_config_sim-epp-gpu-config.yaml",
            "endpoint-attribute-filter",
            "parameter producer ignored: attributes are read by name",
        ),
    ],
)
def test_real_configs_setting_a_producer_name_get_its_note(name, plugin, note):
    """The producer-name parameters real llm-d configs set are noted as ignored (the table
    of ignored parameters lists llm-d's real pairs, not a cross product)."""
    from extproc.flowcontrol.config import FLOW_PLUGIN_TYPES
    from extproc.scheduling.llmd.translate import translate
    from extproc.scheduling.registry import PluginRegistry

    doc = yaml.safe_load((CORPUS / name).read_text())
    t = translate(doc, PluginRegistry.default(), foreign=FLOW_PLUGIN_TYPES)
    assert t.problems == []
    (r,) = [r for r in t.realised if r.type == plugin]
    assert any(n.startswith(note) for n in r.notes), r.notes
