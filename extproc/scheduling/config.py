"""The scheduling configuration, in llm-d's EndpointPickerConfig shape so existing configs
carry over: `plugins` (type, name, parameters) and `schedulingProfiles` (pluginRef, weight)."""

from __future__ import annotations

from typing import Any

import msgspec

from extproc.errors import ConfigError
from extproc.scheduling.framework import (
    Filter,
    NamedFilter,
    Picker,
    Profile,
    Scorer,
    WeightedScorer,
)
from extproc.scheduling.registry import PluginRegistry


class PluginSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: str
    name: str | None = None
    parameters: dict[str, Any] | None = None


class PluginRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pluginRef: str
    weight: float | None = None


class ProfileSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    plugins: list[PluginRef]


class EndpointPickerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    apiVersion: str = "llm-d.ai/v1alpha1"
    kind: str = "EndpointPickerConfig"
    plugins: list[PluginSpec] = msgspec.field(default_factory=list)
    schedulingProfiles: list[ProfileSpec] = msgspec.field(default_factory=list)


def default_config() -> EndpointPickerConfig:
    """Used when no config is given: spread load by in-flight requests."""
    return EndpointPickerConfig(
        plugins=[PluginSpec(type="active-request-scorer"), PluginSpec(type="max-score-picker")],
        schedulingProfiles=[
            ProfileSpec(
                name="default",
                plugins=[
                    PluginRef(pluginRef="active-request-scorer", weight=1.0),
                    PluginRef(pluginRef="max-score-picker"),
                ],
            )
        ],
    )


def build_profiles(config: EndpointPickerConfig, registry: PluginRegistry) -> list[Profile]:
    """Instantiate every plugin once and assemble the profiles that reference them."""
    instances: dict[str, object] = {}
    for i, spec in enumerate(config.plugins):
        name = spec.name or spec.type
        if name in instances:
            raise ConfigError(f"plugins[{i}].name: duplicate plugin name {name!r}")
        instances[name] = registry.build(spec.type, spec.parameters, f"plugins[{i}]")
    if not config.schedulingProfiles:
        raise ConfigError("schedulingProfiles: at least one profile is required")
    profiles = []
    for p, prof in enumerate(config.schedulingProfiles):
        filters: list[NamedFilter] = []
        scorers: list[WeightedScorer] = []
        pickers: list[Picker] = []
        for r, ref in enumerate(prof.plugins):
            where = f"schedulingProfiles[{p}].plugins[{r}]"
            plugin = instances.get(ref.pluginRef)
            if plugin is None:
                raise ConfigError(f"{where}.pluginRef: no plugin named {ref.pluginRef!r}")
            if isinstance(plugin, Scorer):
                weight = 1.0 if ref.weight is None else ref.weight
                if weight <= 0:
                    raise ConfigError(f"{where}.weight: must be positive")
                scorers.append(WeightedScorer(ref.pluginRef, plugin, weight))
            elif isinstance(plugin, Filter):
                filters.append(NamedFilter(ref.pluginRef, plugin))
            elif isinstance(plugin, Picker):
                pickers.append(plugin)
            else:
                raise ConfigError(f"{where}: {ref.pluginRef!r} is not a filter, scorer or picker")
        if len(pickers) > 1:
            raise ConfigError(f"schedulingProfiles[{p}]: more than one picker")
        if not pickers:
            pickers.append(registry.build("max-score-picker", None, f"schedulingProfiles[{p}]"))
        profiles.append(Profile(prof.name, tuple(filters), tuple(scorers), pickers[0]))
    return profiles
