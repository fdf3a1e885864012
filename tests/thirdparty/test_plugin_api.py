"""The plugin author's API: pinned, typed, enough to write and unit-test a scorer, and guarded
against plugins that misbehave."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

import msgspec
import pytest

import extproc
import extproc.plugins as api
from extproc.errors import ConfigError
from extproc.scheduling.config import (
    EndpointPickerConfig,
    PluginRef,
    PluginSpec,
    ProfileSpec,
    build_scheduler,
)
from extproc.scheduling.registry import PluginRegistry
from extproc.testing import make_candidate, make_request, plugin_registry

PINNED = [
    "ENTRY_POINT_GROUP",
    "Api",
    "Candidate",
    "ConfigError",
    "Decision",
    "Endpoint",
    "EndpointState",
    "Filter",
    "InferenceRequest",
    "MediaItem",
    "Message",
    "Modality",
    "Observer",
    "Part",
    "Picker",
    "PluginParams",
    "PluginRegistry",
    "ProfileHandler",
    "ProfileResult",
    "ProfileRunner",
    "Prompt",
    "ResponseHeaders",
    "Scorer",
]


def test_public_plugin_api_is_exactly_the_pinned_list():
    """Removing or renaming a name here breaks plugin authors: it takes a deprecation."""
    assert sorted(api.__all__) == sorted(PINNED)
    for name in api.__all__:
        assert getattr(api, name) is not None


def test_package_is_typed_and_versioned():
    assert (Path(extproc.__file__).parent / "py.typed").is_file()
    assert extproc.__version__ == version("extproc")


def test_a_third_party_scorer_unit_tests_with_extproc_testing_alone(plugin_site):
    from prefer_port import PreferPortScorer

    scorer = plugin_registry(PreferPortScorer).build(
        "prefer-port-scorer", {"port": 9000}, ("plugins", 0)
    )
    cands = [make_candidate("10.0.0.1:8000"), make_candidate("10.0.0.2:9000", waiting=3)]
    assert scorer.score(make_request(blocks=2), cands) == [0.0, 1.0]
    assert isinstance(scorer, api.Scorer)


def test_entry_point_plugin_is_found_and_its_params_are_strict(plugin_site):
    registry = PluginRegistry.default()
    assert "prefer-port-scorer" in registry.type_names
    with pytest.raises(ConfigError, match="unknown field") as err:
        registry.build("prefer-port-scorer", {"prot": 9000}, ("plugins", 3))
    assert err.value.path == ("plugins", 3, "parameters", "prot")


def test_a_blocked_plugin_package_is_never_imported(plugin_site):
    sys.modules.pop("prefer_port", None)
    registry = PluginRegistry.default(disabled=["prefer-port-scorer"])
    assert "prefer-port-scorer" not in registry.type_names
    assert "prefer_port" not in sys.modules


class _Nothing:
    type_name = "does-nothing"

    class Params(api.PluginParams):
        pass


class _Lax:
    type_name = "lax-params-scorer"

    class Params(msgspec.Struct, frozen=True):
        x: int = 0

    def score(self, req, cands):
        return [0.0] * len(cands)


@pytest.mark.parametrize(
    ("cls", "message"),
    [(_Nothing, "implements none of"), (_Lax, "forbid_unknown_fields")],
)
def test_registry_refuses_a_class_that_is_not_a_plugin(cls, message):
    with pytest.raises(ConfigError, match=message):
        plugin_registry(cls)


class _Broken:
    """Returns what `mode` says: NaN, too few scores, out of range, or raises."""

    type_name = "broken-scorer"

    class Params(api.PluginParams):
        mode: str = "nan"

    def __init__(self, params: Params) -> None:
        self.mode = params.mode

    def score(self, req: api.InferenceRequest, cands: Sequence[api.Candidate]) -> list[float]:
        if self.mode == "raise":
            raise RuntimeError("boom")
        if self.mode == "short":
            return [1.0]
        bad = math.nan if self.mode == "nan" else 7.0
        return [bad] + [0.0] * (len(cands) - 1)


@pytest.mark.parametrize("mode", ["nan", "short", "range", "raise"])
def test_a_misbehaving_scorer_loses_its_say_not_the_request(mode):
    cfg = EndpointPickerConfig(
        plugins=[
            PluginSpec(type="broken-scorer", parameters={"mode": mode}),
            PluginSpec(type="queue-scorer"),
            PluginSpec(type="max-score-picker"),
        ],
        schedulingProfiles=[
            ProfileSpec(
                name="default",
                plugins=[
                    PluginRef(pluginRef="broken-scorer", weight=100),
                    PluginRef(pluginRef="queue-scorer", weight=1),
                    PluginRef(pluginRef="max-score-picker"),
                ],
            )
        ],
    )
    scheduler = build_scheduler(cfg, plugin_registry(_Broken))
    cands = [make_candidate("a:1", waiting=50), make_candidate("b:1", waiting=0)]
    decision = scheduler.schedule(make_request(), cands, explain=True)
    # The broken scorer would have sent it to "a"; the queue decides instead.
    assert decision.primary.address == "b:1"
    assert any("broken-scorer ignored" in r for r in decision.reasons)
    faults = scheduler.profiles["default"].faults.counts
    assert faults == {"default/broken-scorer": 1}
