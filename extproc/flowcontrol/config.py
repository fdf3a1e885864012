"""Flow-control configuration: llm-d's `flowControl` section (and the deprecated top-level
`saturationDetector`) read from the raw EndpointPickerConfig mappings, plus extproc's own
`flow_control` settings (fairness weights, objectives, sharing).

llm-d fields and defaults: `maxBytes` / `maxRequests` (global, Kubernetes quantities, unset =
unbounded), `defaultRequestTTL` (60s; "0s" = no TTL), `priorityBands[]` (`priority`,
`maxBytes` default 1G, `maxRequests` default 5000, `orderingPolicyRef` default
`fcfs-ordering-policy`, `fairnessPolicyRef` default `global-strict-fairness-policy`),
`defaultPriorityBand` / `defaultNegativePriorityBand` (templates for unlisted priorities),
`saturationDetector.pluginRef` (default `utilization-detector`; the top-level section also
takes GIE v1.2-v1.4's inline `queueDepthThreshold` / `kvCacheUtilThreshold` /
`metricsStalenessThreshold`), `usageLimitPolicyPluginRef`
(default `static-usage-limit-policy`, ceiling 1.0). Policy and detector refs name entries of
the top-level `plugins` list (by name, else by type), or a type directly. Accepted but not
acted on (a warning at start, a check-config note): `noEndpointRequestTTL`.
`enableEviction` turns on in-flight eviction (flowcontrol/eviction.py) with the eviction
filter and order listed in `plugins` (llm-d's sheddable filter and priority-then-time order
by default; extproc's `lower-band-eviction-filter` lets every band below the highest be
cut). Admitters
(`probabilistic-admitter`) listed in `plugins` are active, and so is extproc's
`prefill-gate` (flowcontrol/prefill_gate.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from extproc.errors import ConfigError
from extproc.flowcontrol.admitters import ADMITTERS, Admitter
from extproc.flowcontrol.controller import BandLimits
from extproc.flowcontrol.detectors import DETECTORS, SaturationDetector, UtilizationDetector
from extproc.flowcontrol.eviction import (
    EVICTION_FILTERS,
    EVICTION_ORDERS,
    EVICTION_PLUGINS,
    EvictionSettings,
)
from extproc.flowcontrol.policies import (
    FAIRNESS as _FAIRNESS,
)
from extproc.flowcontrol.policies import (
    ORDERING,
    USAGE_LIMITS,
    FairnessPolicy,
    OrderingPolicy,
    StaticUsageLimit,
    UsageLimitPolicy,
)
from extproc.flowcontrol.prefill_gate import PrefillGate
from extproc.flowcontrol.programs import ProgramAwareFairness

log = logging.getLogger("extproc.flowcontrol")

FAIRNESS: tuple[type[Any], ...] = (*_FAIRNESS, ProgramAwareFairness)

FLOW_PLUGINS: tuple[type[Any], ...] = (
    *DETECTORS,
    *ORDERING,
    *FAIRNESS,
    *USAGE_LIMITS,
    *ADMITTERS,
    *EVICTION_PLUGINS,
    PrefillGate,
)
ADMITTER_TYPES = frozenset(c.type_name for c in ADMITTERS)
_BY_TYPE = {c.type_name: c for c in FLOW_PLUGINS}
FLOW_PLUGIN_TYPES = frozenset(_BY_TYPE)

_Q = int | str | None


class BandSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    priority: int = 0
    maxBytes: _Q = None
    maxRequests: _Q = None
    fairnessPolicyRef: str = ""
    orderingPolicyRef: str = ""


class PluginRefSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pluginRef: str = ""


class LegacyDetectorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The top-level `saturationDetector`: a `pluginRef` (GIE v1.5+, llm-d), or GIE
    v1.2-v1.4's inline utilization thresholds (the utilization detector's parameters)."""

    pluginRef: str = ""
    queueDepthThreshold: int | None = None
    kvCacheUtilThreshold: float | None = None
    metricsStalenessThreshold: str | None = None

    def inline(self) -> dict[str, Any]:
        fields = ("queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


class FlowControlSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """llm-d's FlowControlConfig, field for field."""

    maxBytes: _Q = None
    maxRequests: _Q = None
    defaultRequestTTL: str | None = None
    noEndpointRequestTTL: str | None = None
    defaultPriorityBand: BandSpec | None = None
    defaultNegativePriorityBand: BandSpec | None = None
    priorityBands: list[BandSpec] = msgspec.field(default_factory=list)
    usageLimitPolicyPluginRef: str = ""
    saturationDetector: PluginRefSpec | None = None
    enableEviction: bool = False


_SIZES_KEPT = 100  # as flowcontrol/reserve.py keeps per band (HISTORY)


class ReservePrior(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a higher band is expected to send, for the reserve before its own history can
    say (`reserve_prior`): the largest request, prompt + output in the picker's tokens
    (uncached prompt estimate + expected output; its prompt alone where the detector counts
    no output, FlowRequest.counted_tokens), and the band's arrival rate in those
    tokens per second (0: no rate term from the prior); `prefill_s`, the largest request's
    prefill time, prices the rate term while no prefill speed is measured yet (a fresh
    picker at a burst's start; 0: the rate term waits for a measured speed)."""

    request_tokens: Annotated[int, msgspec.Meta(gt=0)]
    tokens_per_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    prefill_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class FlowControlSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """extproc's own `flow_control` section (present = flow control on, with llm-d's
    defaults when the scheduling config has no `flowControl` section).

    `fairness_weights`: token share per fairness ID for `weighted-token-fairness-policy`
    (unlisted IDs weigh 1). `objectives_file`: InferenceObjective documents (or a mapping
    name -> priority) naming the priorities `x-llm-d-inference-objective` selects; re-read
    when it changes. `expected_output_tokens`: the output cost counted per request, for fairness
    and for room; a request whose own cap (max_tokens and its spellings) is lower counts
    its cap. `shared`: with a Redis index,
    share queue and usage state with the other replicas. `retry_after_s`: the `retry-after`
    sent with 429s. `usage_half_life_s`: how fast served tokens are forgotten. `tick_s`: how
    often TTLs are checked and endpoint figures re-read for capacity. `placement_visibility_s`:
    with a detector on scraped figures, how long released work still counts as pending after
    placement (about two scrape intervals: until a scrape can show it).
    `admit_per_endpoint` (off by default: without a reserve it measured worse, see
    docs/flow-control.md): release a request only where one endpoint has room for it under
    the band's ceiling (counting what was released to it and not placed yet), and place it
    on such an endpoint; off: by the pool's average saturation alone.
    `reserve_for_higher_bands` (with `admit_per_endpoint`): a lower band's request is
    released only where afterwards some endpoint still has room for this many of the
    largest of the last 100 requests of a higher band together (0, the default: no
    reserve), so higher work finds a server with room instead of waiting for lower work to
    end; while a higher band has fewer than 100 requests of history, at least the room of
    the largest recent requests of any band. `reserve_prior` (priority -> ReservePrior):
    per higher band, its expected largest request and arrival rate, which size the reserve
    (at least) until the band has 100 requests of history: a freshly started picker keeps
    room from its first request instead of from what it happened to see first.
    `reserve_quantile` (0, the default: the largest requests): size the reserve from this
    quantile of a higher band's recent request sizes and prompts instead of the largest
    (e.g. 0.9), with the band's own history trusted alone from 20 requests on
    (flowcontrol/reserve.py). `reserve_rate_quantile` (0, the default: the size term's
    prompt): count the arrival-rate term over the prefill time of this quantile of the
    band's recent prompts (from 20 requests on), the size term unchanged.
    `reserve_refill_s` (0, the default: off): an endpoint may keep that much less of the
    reserve as it is expected to free within this many seconds (the tokens of the requests
    that ended there over the last 3 s, per second, times this), so a higher-band request
    as large as the reserve waits at most about this long for room, and the room is not
    kept idle meanwhile (flowcontrol/refill.py). `reserve_refill_credit` (`rate`, as above;
    `auto`, the default: `started` with the joint reserve below, else `rate`): `predicted`
    counts instead the tokens of the requests on the endpoint predicted to end within the
    horizon (start plus counted output times the measured per-output-token time of the
    recent ends; the rate until 8 ends measured it): the ends' rate is right on average but
    lumpy, and the room it credited came back later about half the time
    (flowcontrol/refill.py); `started` predicts each request's end from its decode's start
    instead, as the scraped count of the engine's requests before their first token shows it
    (not credited before; from placement on an engine without that count): a request that
    queued in the engine ended later than predicted from placement.
    `reserve_refill_floor` (0, the default: none; opt-in): with `reserve_refill_s`, an
    endpoint keeps at least this share of the reserve whatever the credit (0..1); 0.8 is
    the measured setting (the tail for goodput, not both of issue 15's targets more often).
    `reserve_spike_s` (0,
    the default: off): the reserve's arrival-rate term is instead the
    `reserve_spike_quantile` (`auto`, the default: 0.95 with the joint reserve below, else
    0.9) of the tokens a higher band sent within this many seconds before each of its recent
    requests (from 20 requests of history on): room for the work that arrives close behind
    another, not the mean rate's; with shared flow state, over the fleet's arrivals
    (flowcontrol/reserve.py). `reserve_spike_joint` (with `reserve_spike_s`; `auto`, the
    default: on, for one picker and replicas sharing flow state alike,
    flowcontrol/spike_auto.py): the quantile is instead of each recent request's clump, the
    tokens before it plus its own, and the reserve is that or the largest request, whichever
    is more, not the two added: it covers that share of the band's requests rather than
    nearly all, and does not jump by a whole large request with the arrival draw.
    `output_token_scale` (1.0, the default: none): each request's counted output (above)
    times this, so it adds up with the prompt estimate in one unit: the picker's estimated
    prompt tokens per real token where that estimate runs over or under the engine's count
    (a bytes-per-token off the tokenizer's); set the concurrency detector's `outputTokens`
    in the same units. `auto`: measured, from calibration's engine prompt tokens per
    estimated token (1.0 until measured; flowcontrol/output_scale.py).
    `count_engine_blocks` (off by default; with `admit_per_endpoint` and the concurrency
    detector's `kvCacheFraction`): the room checks count each request as its engine holds
    it, its prompt in engine tokens (calibration's measured ratio) plus its output, rounded
    up to whole KV blocks, times the fraction; until calibration measures, at the inverse of
    the fraction (logged, counted: flowcontrol/engine_blocks.py). So counted: the top band's
    requests and the room every band must leave for the reserve; a lower band's request
    itself fits by its tokens (it may over-commit a server the reserve is not kept on, the
    engine queues it), unless `engine_blocks_lower_bands: blocks` (all of it by blocks, the
    twenty-first session's form).
    `waiting_claims_room` (off by default; with `admit_per_endpoint`): in a band above the
    lowest, a request that found no endpoint with room is tried before the band's newer
    requests at every dispatch opportunity, and the endpoint where it comes closest to
    fitting is kept for it from them (flowcontrol/claims.py).
    `dispatch_on_end` (on by default): a request's end (its access-log entry, when
    in-flight counts are held to the end) is a dispatch opportunity at once; off: the room it
    frees is used at the next tick or arrival (up to `tick_s` later; the behaviour before,
    kept to measure against).
    `engine_priority` (off by default): send the request's band to the model server as its
    priority (`-band`: vLLM's priority scheduling serves lower values first), replacing any
    the client sent (`flowcontrol/engine_priority.py`): `body` (or `true`) writes it into
    the forwarded body as `priority`, `header` sends it as the `x-vllm-priority` header and
    leaves the body alone.
    `evict_per_endpoint` (off by default; with `enableEviction` and `admit_per_endpoint`): a
    request of a band above the lowest that finds no endpoint with room gets room made on
    the endpoint where it comes closest to fitting: the fewest lower-band requests there
    the eviction order ranks first (the most recently dispatched) whose tokens make it fit
    are cut (where all of them would not, on the next closest endpoint), instead of
    llm-d's pool-wide count (flowcontrol/eviction.py)."""

    fairness_weights: dict[str, Annotated[float, msgspec.Meta(gt=0)]] = msgspec.field(
        default_factory=dict
    )
    objectives_file: str | None = None
    expected_output_tokens: Annotated[int, msgspec.Meta(ge=0)] = 256
    shared: bool = True
    retry_after_s: Annotated[int, msgspec.Meta(ge=0)] = 1
    usage_half_life_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    tick_s: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.02
    share_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.1
    placement_visibility_s: Annotated[float, msgspec.Meta(ge=0)] = 0.1
    admit_per_endpoint: bool = False
    reserve_for_higher_bands: Annotated[int, msgspec.Meta(ge=0, le=_SIZES_KEPT)] = 0
    reserve_prior: dict[int, ReservePrior] = msgspec.field(default_factory=dict)
    reserve_quantile: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    reserve_rate_quantile: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    reserve_refill_s: Annotated[float, msgspec.Meta(ge=0, le=10)] = 0.0
    reserve_refill_credit: Literal["rate", "predicted", "started", "auto"] = "auto"
    reserve_refill_floor: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    reserve_spike_s: Annotated[float, msgspec.Meta(ge=0, le=10)] = 0.0
    reserve_spike_quantile: Annotated[float, msgspec.Meta(gt=0, le=1)] | Literal["auto"] = "auto"
    reserve_spike_joint: bool | Literal["auto"] = "auto"
    output_token_scale: Annotated[float, msgspec.Meta(gt=0, le=4)] | Literal["auto"] = 1.0
    count_engine_blocks: bool = False
    engine_blocks_lower_bands: Literal["tokens", "blocks"] = "tokens"
    waiting_claims_room: bool = False
    dispatch_on_end: bool = True
    engine_priority: bool | Literal["body", "header"] = False
    evict_per_endpoint: bool = False


_DUR = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_DUR_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_QTY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_QTY_UNIT = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
}


def parse_duration(text: str) -> float:
    """A Go/metav1 duration ("60s", "1m30s", "200ms") in seconds."""
    pos, total = 0, 0.0
    for m in _DUR.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DUR_UNIT[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ConfigError(f"invalid duration {text!r} (e.g. 60s, 500ms, 1m30s)")
    return total


def parse_quantity(value: int | str | None) -> int:
    """A Kubernetes quantity ("1Gi", "500M", "5k", 100) as an integer; None = 0."""
    if value is None:
        return 0
    if isinstance(value, int):
        if value < 0:
            raise ConfigError("must be non-negative")
        return value
    m = _QTY.match(value.strip())
    if not m:
        raise ConfigError(f"invalid quantity {value!r} (e.g. 100, 5k, 1Gi)")
    return int(float(m.group(1)) * _QTY_UNIT[m.group(2)])


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """Everything the controller needs, resolved."""

    detector: SaturationDetector
    ttl_s: float = 60.0
    max_requests: int = 0
    max_bytes: int = 0
    bands: Mapping[int, BandSpec] = field(default_factory=dict)
    default_band: BandSpec | None = None
    default_negative_band: BandSpec | None = None
    policies: Mapping[str, tuple[type[Any], Any]] = field(default_factory=dict)
    usage_limit: UsageLimitPolicy = field(default_factory=StaticUsageLimit)
    admitters: tuple[Admitter, ...] = ()
    settings: FlowControlSettings = field(default_factory=FlowControlSettings)
    eviction: EvictionSettings | None = None  # `enableEviction`
    gate: PrefillGate | None = None  # `prefill-gate` listed in plugins

    def band(self, priority: int) -> tuple[BandLimits, OrderingPolicy, FairnessPolicy]:
        """Limits and fresh policy instances for a band (each band keeps its own state)."""
        spec = self.bands.get(priority)
        if spec is None:
            spec = self.default_negative_band if priority < 0 else None
            spec = spec or self.default_band or BandSpec()
        limits = BandLimits(
            priority,
            max_requests=parse_quantity(spec.maxRequests) or 5000,
            max_bytes=parse_quantity(spec.maxBytes) or 1_000_000_000,
        )
        ordering = self._make(spec.orderingPolicyRef or "fcfs-ordering-policy")
        fairness = self._make(spec.fairnessPolicyRef or "global-strict-fairness-policy")
        return limits, ordering, fairness

    # Instances of policies whose state spans bands (one per plugin, as in llm-d).
    _shared: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def _make(self, ref: str) -> Any:
        cls, params = self.policies.get(ref) or (_BY_TYPE[ref], None)
        if getattr(cls, "spans_bands", False):
            if ref not in self._shared:
                self._shared[ref] = cls(params)
            return self._shared[ref]
        return cls(params)


def _decode(cls: type, doc: Any, where: tuple[str | int, ...]) -> Any:
    from extproc.scheduling.registry import validation_error

    try:
        return msgspec.convert(doc if doc is not None else {}, cls)
    except msgspec.ValidationError as exc:
        raise validation_error(exc, where) from None


def build_flow_config(
    flow_control: Mapping[str, Any] | None,
    saturation_detector: Mapping[str, Any] | None,
    plugins: Sequence[Mapping[str, Any]],
    settings: FlowControlSettings | None = None,
) -> FlowConfig:
    """Resolve the raw llm-d sections. `plugins` is the config's plugin list (`type`,
    optional `name` and `parameters`); flow-control types among them are built here, others
    ignored. Raises ConfigError located in the document."""
    spec: FlowControlSpec = _decode(FlowControlSpec, flow_control, ("flowControl",))
    named: dict[str, tuple[type[Any], Any]] = {}
    admitters: list[Admitter] = []
    gate: PrefillGate | None = None
    for i, p in enumerate(plugins):
        cls = _BY_TYPE.get(p.get("type", ""))
        if cls is None:
            continue
        params = _decode(cls.Params, p.get("parameters"), ("plugins", i, "parameters"))
        named[p.get("name") or p["type"]] = (cls, params)
        if cls in ADMITTERS:
            admitters.append(cls(params))  # listed = active, as in llm-d
        if cls is PrefillGate:
            if gate is not None:
                raise ConfigError("prefill-gate listed twice", path=("plugins", i))
            try:
                gate = PrefillGate(params)  # listed = active, as admitters are
            except ConfigError as exc:
                raise exc.within("plugins", i, "parameters", "activeWindow") from None

    def resolve(ref: str, kind: tuple[type[Any], ...], where: tuple[str | int, ...]) -> None:
        got = named.get(ref) or ((_BY_TYPE[ref], None) if ref in _BY_TYPE else None)
        if got is None or got[0] not in kind:
            known = ", ".join(c.type_name for c in kind)
            raise ConfigError(f"{ref!r} is not a plugin of a known kind ({known})", path=where)
        named.setdefault(ref, got)

    det_ref = "utilization-detector"
    legacy = _decode(LegacyDetectorSpec, saturation_detector, ("saturationDetector",))
    inline = legacy.inline()
    if inline and legacy.pluginRef:
        raise ConfigError(
            "give either pluginRef or inline thresholds, not both", path=("saturationDetector",)
        )
    if inline:
        # GIE v1.2-v1.4: the thresholds configure the (only) utilization detector.
        named["saturationDetector"] = (
            UtilizationDetector,
            _decode(UtilizationDetector.Params, inline, ("saturationDetector",)),
        )
    if spec.saturationDetector and spec.saturationDetector.pluginRef:
        det_ref = spec.saturationDetector.pluginRef
        where: tuple[str | int, ...] = ("flowControl", "saturationDetector", "pluginRef")
    elif legacy.pluginRef:
        det_ref, where = legacy.pluginRef, ("saturationDetector", "pluginRef")
    elif inline:
        det_ref, where = "saturationDetector", ("saturationDetector",)
    else:
        where = ("flowControl",)
    resolve(det_ref, DETECTORS, where)
    det_cls, det_params = named[det_ref]
    bands: dict[int, BandSpec] = {}
    all_bands: list[tuple[tuple[str | int, ...], BandSpec]] = [
        (("flowControl", "priorityBands", i), b) for i, b in enumerate(spec.priorityBands)
    ]
    for key in ("defaultPriorityBand", "defaultNegativePriorityBand"):
        b = getattr(spec, key)
        if b is not None:
            all_bands.append((("flowControl", key), b))
    for path, b in all_bands:
        for attr in ("maxBytes", "maxRequests"):
            try:
                parse_quantity(getattr(b, attr))
            except ConfigError as exc:
                raise exc.within(*path, attr) from None
        if b.orderingPolicyRef:
            resolve(b.orderingPolicyRef, ORDERING, (*path, "orderingPolicyRef"))
        if b.fairnessPolicyRef:
            resolve(b.fairnessPolicyRef, FAIRNESS, (*path, "fairnessPolicyRef"))
        if path[1] == "priorityBands":
            if b.priority in bands:
                raise ConfigError(f"priority {b.priority} listed twice", path=path)
            bands[b.priority] = b
    ttl = 60.0
    if spec.defaultRequestTTL is not None:
        try:
            ttl = parse_duration(spec.defaultRequestTTL)
        except ConfigError as exc:
            raise exc.within("flowControl", "defaultRequestTTL") from None
    try:
        max_requests = parse_quantity(spec.maxRequests)
        max_bytes = parse_quantity(spec.maxBytes)
    except ConfigError as exc:
        raise exc.within("flowControl") from None
    usage_limit: UsageLimitPolicy = StaticUsageLimit()
    if spec.usageLimitPolicyPluginRef:
        where = ("flowControl", "usageLimitPolicyPluginRef")
        resolve(spec.usageLimitPolicyPluginRef, USAGE_LIMITS, where)
        cls, params = named[spec.usageLimitPolicyPluginRef]
        if params is None:  # referenced by type alone: its parameters take their defaults
            params = _decode(cls.Params, {}, where)
        usage_limit = cls(params)
    if spec.noEndpointRequestTTL:
        log.warning("flowControl.noEndpointRequestTTL is accepted but not implemented: ignored")
    detector = det_cls(det_params)
    settings = settings or FlowControlSettings()
    eviction = None
    if spec.enableEviction:
        eviction = _eviction(named, detector, settings)
    return FlowConfig(
        detector=detector,
        ttl_s=ttl,
        max_requests=max_requests,
        max_bytes=max_bytes,
        bands=bands,
        default_band=spec.defaultPriorityBand,
        default_negative_band=spec.defaultNegativePriorityBand,
        policies=named,
        usage_limit=usage_limit,
        admitters=tuple(admitters),
        settings=settings,
        eviction=eviction,
        gate=gate,
    )


def _eviction(
    named: Mapping[str, tuple[type[Any], Any]],
    detector: SaturationDetector,
    settings: FlowControlSettings,
) -> EvictionSettings:
    """`enableEviction`: the filter and order listed in `plugins` (llm-d's defaults when
    none is), and the pacing grace the detector needs to see freed capacity: a few ticks
    for in-flight counts; for scraped figures the staleness bound, the placement visibility
    window and llm-d's 250 ms engine-reclaim budget."""
    filt = next((c(p) for c, p in named.values() if c in EVICTION_FILTERS), None)
    order = next((c(p) for c, p in named.values() if c in EVICTION_ORDERS), None)
    if getattr(detector, "sees_placement", True):
        grace = max(0.01, 2 * settings.tick_s)
    else:
        stale = float(getattr(detector, "stale_after_s", 0.2))
        grace = stale + settings.placement_visibility_s + 0.25
    return EvictionSettings(
        filter=filt or EVICTION_FILTERS[0](),
        order=order or EVICTION_ORDERS[0](),
        grace_s=grace,
    )


BandFactory = Callable[[int], tuple[BandLimits, OrderingPolicy, FairnessPolicy]]
