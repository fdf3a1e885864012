"""The sections of llm-d's EndpointPickerConfig besides `plugins` and `schedulingProfiles`,
decoded strictly so a misspelt key is reported, not dropped.

Field names and nesting follow llm-d's config API (`llm-d.ai/v1alpha1`, the deprecated
`inference.networking.x-k8s.io/v1alpha1` group, and `llm-d.ai/v1`, taken as the same shape).
What each section turns on in extproc is decided in `llmd.translate` and reported by
`llmd.check`; these Structs only hold the data.
"""

from __future__ import annotations

import msgspec

API_VERSIONS = (
    "llm-d.ai/v1alpha1",
    "llm-d.ai/v1",
    "inference.networking.x-k8s.io/v1alpha1",
)


class _Strict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class PluginRefSpec(_Strict):
    """`{pluginRef: name}`: parsers, saturation detectors, discovery."""

    pluginRef: str = ""


class SaturationDetectorConfig(_Strict):
    """llm-d names a detector plugin; GIE v1.2-v1.5 configured the built-in one inline."""

    pluginRef: str = ""
    queueDepthThreshold: int | None = None
    kvCacheUtilThreshold: float | None = None
    metricsStalenessThreshold: str | None = None


class ExtractorRef(_Strict):
    pluginRef: str


class DataLayerSource(_Strict):
    pluginRef: str
    extractors: list[ExtractorRef] = msgspec.field(default_factory=list)


class DataLayerConfig(_Strict):
    injectDefaults: bool | None = None
    sources: list[DataLayerSource] = msgspec.field(default_factory=list)
    discovery: PluginRefSpec | None = None
    peerDiscovery: PluginRefSpec | None = None
    crossReplicaSyncerPluginRef: str | None = None
    crossReplicaSyncInterval: str | None = None


class RequestHandlerConfig(_Strict):
    parsers: list[PluginRefSpec] = msgspec.field(default_factory=list)


class PriorityBandConfig(_Strict):
    priority: int = 0
    maxBytes: int | str | None = None
    maxRequests: int | str | None = None
    fairnessPolicyRef: str | None = None
    orderingPolicyRef: str | None = None


class FlowControlConfig(_Strict):
    maxBytes: int | str | None = None
    maxRequests: int | str | None = None
    defaultRequestTTL: str | None = None
    noEndpointRequestTTL: str | None = None
    defaultPriorityBand: PriorityBandConfig | None = None
    defaultNegativePriorityBand: PriorityBandConfig | None = None
    priorityBands: list[PriorityBandConfig] = msgspec.field(default_factory=list)
    usageLimitPolicyPluginRef: str | None = None
    saturationDetector: SaturationDetectorConfig | None = None
    enableEviction: bool = False


def flow_control_refs(fc: FlowControlConfig) -> list[tuple[tuple[str | int, ...], str]]:
    """(path, plugin name) of every plugin a flowControl section names."""
    refs: list[tuple[tuple[str | int, ...], str]] = []
    if fc.usageLimitPolicyPluginRef:
        refs.append((("usageLimitPolicyPluginRef",), fc.usageLimitPolicyPluginRef))
    if fc.saturationDetector and fc.saturationDetector.pluginRef:
        refs.append((("saturationDetector", "pluginRef"), fc.saturationDetector.pluginRef))
    bands: list[tuple[tuple[str | int, ...], PriorityBandConfig]] = []
    if fc.defaultPriorityBand:
        bands.append((("defaultPriorityBand",), fc.defaultPriorityBand))
    if fc.defaultNegativePriorityBand:
        bands.append((("defaultNegativePriorityBand",), fc.defaultNegativePriorityBand))
    bands.extend((("priorityBands", i), b) for i, b in enumerate(fc.priorityBands))
    for where, band in bands:
        if band.fairnessPolicyRef:
            refs.append(((*where, "fairnessPolicyRef"), band.fairnessPolicyRef))
        if band.orderingPolicyRef:
            refs.append(((*where, "orderingPolicyRef"), band.orderingPolicyRef))
    return refs
