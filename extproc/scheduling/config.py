"""The scheduling configuration, in llm-d's EndpointPickerConfig shape so existing configs
carry over: `plugins` (type, name, parameters) and `schedulingProfiles` (pluginRef, weight).

Loading runs in stages, each raising `ConfigError` with the path of the offending field:
decode (msgspec, strict) -> build plugins (registry, strict params) -> assemble profiles ->
the Scheduler.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import msgspec

from extproc.errors import ConfigError
from extproc.scheduling.framework import (
    Admitter,
    Binds,
    Filter,
    NamedFilter,
    Observer,
    Picker,
    Profile,
    ProfileHandler,
    ResponseHeaders,
    Scheduler,
    Scorer,
    WeightedScorer,
)
from extproc.scheduling.handlers import SingleProfileHandler
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
    # llm-d's flow-control sections, kept raw: extproc.flowcontrol.config reads them.
    flowControl: dict[str, Any] | None = None
    saturationDetector: dict[str, Any] | None = None


def default_config() -> EndpointPickerConfig:
    """Used when no scheduling config is given: cache affinity weighed against live load in
    one currency, predicted time to first token (`predicted-ttft-scorer`: queued prefill
    work plus this request's uncached tokens, over each server's measured prefill speed), so
    a request sticks to its prefix until waiting there costs more than recomputing
    elsewhere (plus, in a full cache, the recompute of what moving evicts there).
    Filters first: `bounded-sessions-filter` places a request that starts a
    session (agentic and chat sessions are idle between turns, so in-flight counts miss
    them) only where live sessions stay within an even share of the fleet's KV capacity,
    replicating a shared agent prompt instead of piling every session onto its first
    holder; `bounded-load-filter` keeps a prefix group from piling onto one server beyond
    (1 + 0.25) x the mean in-flight load + 1 (later turns of a session are left to the
    scorers, `session-tail-scorer` keeping them home on near-ties). `kv-cache-utilization-scorer`
    breaks near-ties towards emptier caches, and
    `no-hit-lru-scorer` spreads new prefixes over the fleet (when a prefix is new, every
    prediction is about equal, and where a conversation group settles would be down to
    chance). Before issue 14 the default was prefix 3, queue 2, KV usage 2, active requests
    2, no-hit-lru 2 (llm-d's defaults plus our in-flight count); bench/RESULTS.md compares.
    """
    filters = ("bounded-sessions-filter", "bounded-load-filter")
    weights = {
        "predicted-ttft-scorer": 4.0,
        "kv-cache-utilization-scorer": 1.0,
        "no-hit-lru-scorer": 1.0,
        "session-tail-scorer": 2.0,
    }
    return EndpointPickerConfig(
        plugins=[PluginSpec(type=t) for t in (*filters, *weights, "max-score-picker")],
        schedulingProfiles=[
            ProfileSpec(
                name="default",
                plugins=[
                    *(PluginRef(pluginRef=t) for t in filters),
                    *(PluginRef(pluginRef=t, weight=w) for t, w in weights.items()),
                    PluginRef(pluginRef="max-score-picker"),
                ],
            )
        ],
    )


def build_scheduler(
    config: EndpointPickerConfig,
    registry: PluginRegistry,
    *,
    fallbacks: int = 0,
    foreign: Collection[str] = (),
) -> Scheduler:
    """Instantiate every plugin once and assemble the profiles that reference them. Error
    paths are relative to the config document (`plugins[2].parameters: ...`). Plugins of a
    `foreign` type (flow control's, listed in the same `plugins` section as in llm-d) are
    another layer's to build: skipped here, and no profile may reference them."""
    instances: dict[str, object] = {}
    for i, spec in enumerate(config.plugins):
        name = spec.name or spec.type
        if name in instances:
            raise ConfigError(f"duplicate plugin name {name!r}", path=("plugins", i, "name"))
        if spec.type in foreign:
            instances[name] = None
            continue
        instances[name] = registry.build(spec.type, spec.parameters, ("plugins", i))
    for i, plugin in enumerate(instances.values()):
        if isinstance(plugin, Binds):
            try:
                plugin.bind(instances)
            except ConfigError as exc:
                raise ConfigError(exc.message, path=("plugins", i)) from None
    if not config.schedulingProfiles:
        raise ConfigError("at least one profile is required", path=("schedulingProfiles",))
    handlers = [p for p in instances.values() if isinstance(p, ProfileHandler)]
    if len(handlers) > 1:
        raise ConfigError("more than one profile handler", path=("plugins",))
    used: dict[str, object] = {}
    profiles = []
    for p, prof in enumerate(config.schedulingProfiles):
        filters: list[NamedFilter] = []
        scorers: list[WeightedScorer] = []
        pickers: list[Picker] = []
        for r, ref in enumerate(prof.plugins):
            where = ("schedulingProfiles", p, "plugins", r)
            plugin = instances.get(ref.pluginRef)
            if plugin is None:
                msg = (
                    f"{ref.pluginRef!r} is a flow-control plugin, not a scheduling one"
                    if ref.pluginRef in instances
                    else f"no plugin named {ref.pluginRef!r}"
                )
                raise ConfigError(msg, path=(*where, "pluginRef"))
            used[ref.pluginRef] = plugin
            if isinstance(plugin, Scorer):
                weight = 1.0 if ref.weight is None else ref.weight
                if weight <= 0:
                    raise ConfigError("must be positive", path=(*where, "weight"))
                scorers.append(WeightedScorer(ref.pluginRef, plugin, weight))
                if isinstance(plugin, Filter):  # both, like llm-d's context-length-aware
                    filters.append(NamedFilter(ref.pluginRef, plugin))
            elif isinstance(plugin, Filter):
                filters.append(NamedFilter(ref.pluginRef, plugin))
            elif isinstance(plugin, Picker):
                pickers.append(plugin)
            else:
                raise ConfigError(
                    f"{ref.pluginRef!r} is not a filter, scorer or picker", path=where
                )
        if len(pickers) > 1:
            raise ConfigError("more than one picker", path=("schedulingProfiles", p))
        if not pickers:
            pickers.append(registry.build("max-score-picker", None, ("schedulingProfiles", p)))
        profiles.append(Profile(prof.name, tuple(filters), tuple(scorers), pickers[0]))
    return Scheduler(
        handlers[0] if handlers else SingleProfileHandler(),
        profiles,
        fallbacks=fallbacks,
        observers=[p for p in used.values() if isinstance(p, Observer)],
        responders=[p for p in used.values() if isinstance(p, ResponseHeaders)],
        admitters=[p for p in instances.values() if isinstance(p, Admitter)],
        plugins=list(instances.values()),
    )
