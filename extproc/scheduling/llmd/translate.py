"""The edge where an llm-d EndpointPickerConfig becomes extproc's: every section, every plugin
classified (implemented / mapped / pending / refused, see `llmd.table`), extproc's own older
parameter names translated to llm-d's (the documented aliases live here and nowhere else),
and every problem collected with its path instead of stopping at the first.

`translate(doc, registry)` takes the parsed YAML mapping and returns a `Translation`: the
scheduling config the plugin registry builds (scheduling plugins only), the `Plumbing`
(settings) the data-plumbing plugins imply, one `Realised` line per plugin for check-config,
and the problems. Nothing is built when there are problems.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from extproc.errors import ConfigError
from extproc.scheduling.config import EndpointPickerConfig, PluginRef, PluginSpec, ProfileSpec
from extproc.scheduling.llmd import shape
from extproc.scheduling.llmd.ignored import ignored_notes
from extproc.scheduling.llmd.mapped import (
    APPROX_IGNORED,
    MAPPED,
    ApproxProducerParams,
    Plumbing,
    approx,
    parse_duration_s,
)
from extproc.scheduling.llmd.table import (
    IGNORED_PARAMS,
    KNOWN_FEATURE_GATES,
    LLMD_TYPES,
    PENDING_FEATURE_GATES,
    PENDING_SECTIONS,
    PENDING_TYPES,
    PENDING_VALUES,
    REFUSED,
)
from extproc.scheduling.registry import PluginRegistry, validation_error

Path = tuple[str | int, ...]
Kind = Literal["implemented", "mapped", "pending", "refused", "unknown"]

ALIAS_REMOVAL = "extproc 0.3"

# extproc's own earlier parameter names -> llm-d's. Translated here, nowhere else; a config
# using one gets a note saying so. Removed in ALIAS_REMOVAL.
ALIASES: dict[str, dict[str, str]] = {
    "prefix-cache-affinity-filter": {
        "threshold": "affinityThreshold",
        "peakPrefillTokensPerSecond": "peakPrefillThroughput",
    },
    "session-affinity-scorer": {"header": "encodedEndpointHeaderConfig.header"},
}

# llm-d's own deprecated disagg-profile-handler parameters -> the current ones.
_DISAGG_LEGACY = {
    "decodeProfile": ("profiles", "decode"),
    "prefillProfile": ("profiles", "prefill"),
    "encodeProfile": ("profiles", "encode"),
    "prefillDeciderPluginName": ("deciders", "prefill"),
    "deciderPluginName": ("deciders", "prefill"),
    "encodeDeciderPluginName": ("deciders", "encode"),
}

# The older llm-d prefix-cache-scorer carried the approximate producer's parameters itself.
_PREFIX_LEGACY = frozenset(
    {
        "blockSize",
        "blockSizeTokens",
        "autoTune",
        "maxPrefixBlocksToMatch",
        "maxPrefixTokensToMatch",
        "lruCapacityPerServer",
        "hashBlockSize",
    }
)

_TOP_LEVEL = (
    "apiVersion",
    "kind",
    "featureGates",
    "plugins",
    "schedulingProfiles",
    "dataLayer",
    "flowControl",
    "requestHandler",
    "saturationDetector",
    "parser",
)


@dataclass(frozen=True, slots=True)
class Problem:
    path: Path
    message: str

    def error(self) -> ConfigError:
        return ConfigError(self.message, path=self.path)


@dataclass(frozen=True, slots=True)
class Realised:
    """How one configured plugin is realised: `how` for check-config, `notes` for parameters
    that are translated or ignored."""

    name: str
    type: str
    kind: Kind
    how: str
    notes: tuple[str, ...] = ()


@dataclass(slots=True)
class Translation:
    config: EndpointPickerConfig | None
    plumbing: Plumbing = field(default_factory=Plumbing)
    realised: list[Realised] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _decode(value: Any, typ: type, path: Path, problems: list[Problem]) -> Any:
    try:
        return msgspec.convert(value, typ)
    except msgspec.ValidationError as exc:
        err = validation_error(exc, path)
        if err.message == "unknown field" and isinstance(err.path[-1], str):
            fields = [f.encode_name for f in msgspec.structs.fields(typ)]
            err = ConfigError(err.message + did_you_mean(err.path[-1], fields), path=err.path)
        problems.append(Problem(err.path, err.message))
        return None


def _apply_aliases(type_name: str, params: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    table = ALIASES.get(type_name, {})
    out = dict(params)
    for ours, theirs in table.items():
        if ours not in out:
            continue
        value = out.pop(ours)
        head, _, tail = theirs.partition(".")
        if tail:
            out[head] = {**(out.get(head) or {}), tail: value}
        else:
            out[head] = value
        notes.append(
            f"parameter {ours} is extproc's older name for llm-d's {theirs} "
            f"(accepted until {ALIAS_REMOVAL})"
        )
    return out


def _disagg_params(name: str, params: dict[str, Any], notes: list[str]) -> tuple[dict, dict]:
    """llm-d's deprecated handler parameters -> current ones; extproc's `threshold` becomes
    an implicit prefix-based-pd-decider. Returns (params, implicit decider params or {})."""
    out = dict(params)
    for old, (group, key) in _DISAGG_LEGACY.items():
        if old in out:
            value = out.pop(old)
            sub = dict(out.get(group) or {})
            sub.setdefault(key, value)
            out[group] = sub
            notes.append(f"parameter {old} is deprecated in llm-d: use {group}.{key}")
    implicit: dict[str, Any] = {}
    if "threshold" in out:
        threshold = out.pop("threshold")
        if isinstance(threshold, int) and threshold >= 0:
            implicit = {"nonCachedTokens": threshold + 1}
            deciders = dict(out.get("deciders") or {})
            deciders.setdefault("prefill", f"{name}-prefill-decider")
            out["deciders"] = deciders
            notes.append(
                "parameter threshold is extproc's older spelling of a prefix-based-pd-decider "
                f"with nonCachedTokens: {threshold + 1} (accepted until {ALIAS_REMOVAL})"
            )
        else:
            out["threshold"] = threshold  # let strict decoding report it
    return out, implicit


def _ignored_reasons(type_name: str) -> dict[str, str]:
    """IGNORED_PARAMS' rows for one type: parameter -> why."""
    return {p: why for (t, p), why in IGNORED_PARAMS.items() if t == type_name}


def translate(doc: Any, registry: PluginRegistry, *, foreign: Collection[str] = ()) -> Translation:
    """Classify and translate a parsed EndpointPickerConfig mapping (see module doc).
    `foreign`: plugin types another subsystem builds from the same config (flow control's
    detectors, policies and admitters); they are kept in the plugin list for it."""
    t = Translation(config=None)
    problems = t.problems
    if not isinstance(doc, dict):
        problems.append(Problem((), "expected a mapping (an EndpointPickerConfig)"))
        return t
    for key in doc:
        if key not in _TOP_LEVEL:
            problems.append(Problem((key,), "unknown field" + did_you_mean(str(key), _TOP_LEVEL)))
    api = doc.get("apiVersion", "llm-d.ai/v1alpha1")
    if api not in shape.API_VERSIONS:
        problems.append(
            Problem(
                ("apiVersion",),
                f"unsupported apiVersion {api!r} (supported: {', '.join(shape.API_VERSIONS)})"
                + did_you_mean(str(api), shape.API_VERSIONS),
            )
        )
    if doc.get("kind", "EndpointPickerConfig") != "EndpointPickerConfig":
        problems.append(Problem(("kind",), "must be EndpointPickerConfig"))

    specs = _plugins(doc.get("plugins"), registry, t, foreign)
    if t.plumbing.topology_labels:
        # The topology extractor's label keys reach the topology plugins as parameters.
        labels = {level: key for level, key in t.plumbing.topology_labels}
        specs = [
            (n, _with_labels(s, labels) if s and s.type.startswith("topology-affinity") else s)
            for n, s in specs
        ]
    known_names = {n for n, _ in specs}
    _sections(doc, specs, t)
    _check_attributes(doc.get("plugins"), specs, problems)
    failed = {r.name for r in t.realised if r.kind in ("pending", "refused", "unknown")}
    profiles = _profiles(doc.get("schedulingProfiles"), specs, known_names, failed, problems)
    if problems:
        return t
    kept = [s for _, s in specs if s is not None]
    fc, sd = doc.get("flowControl"), doc.get("saturationDetector")
    t.config = EndpointPickerConfig(
        plugins=kept,
        schedulingProfiles=profiles,
        # Raw, for extproc.flowcontrol.config, which reads and validates them itself.
        flowControl=fc if isinstance(fc, dict) else None,
        saturationDetector=sd if isinstance(sd, dict) else None,
    )
    return t


def _plugins(
    raw: Any, registry: PluginRegistry, t: Translation, foreign: Collection[str]
) -> list[tuple[str, PluginSpec | None]]:
    """(name, scheduling spec or None for plumbing) per plugin, in config order."""
    problems = t.problems
    if raw is None:
        return []
    if not isinstance(raw, list):
        problems.append(Problem(("plugins",), "expected a list"))
        return []
    out: list[tuple[str, PluginSpec | None]] = []
    seen: set[str] = set()
    implicit: list[PluginSpec] = []
    known = {*registry.type_names, *LLMD_TYPES, *MAPPED, *foreign}
    for i, item in enumerate(raw):
        where: Path = ("plugins", i)
        spec = _decode(item, PluginSpec, where, problems)
        if spec is None:
            continue
        name = spec.name or spec.type
        if name in seen:
            problems.append(Problem((*where, "name"), f"duplicate plugin name {name!r}"))
        seen.add(name)
        params = dict(spec.parameters or {})
        notes: list[str] = []
        kind: Kind
        if spec.type in registry.type_names:
            kind, how = "implemented", "implemented"
            params = _apply_aliases(spec.type, params, notes)
            if spec.type == "disagg-profile-handler":
                params, decider = _disagg_params(name, params, notes)
                if decider:
                    implicit.append(
                        PluginSpec(
                            type="prefix-based-pd-decider",
                            name=params["deciders"]["prefill"],
                            parameters=decider,
                        )
                    )
            if spec.type == "prefix-cache-scorer" and _PREFIX_LEGACY & set(params):
                legacy = {k: params.pop(k) for k in list(params) if k in _PREFIX_LEGACY}
                decoded = _decode(legacy, ApproxProducerParams, (*where, "parameters"), problems)
                if decoded is not None:
                    # The producer's notes (autoTune) hold for the older spelling too.
                    plumbing, extra = approx(decoded)
                    t.plumbing = t.plumbing.merge(plumbing)
                    notes.extend(extra)
                    notes.extend(ignored_notes(APPROX_IGNORED, legacy))
                    how = "implemented; its producer parameters configure the approximate index"
            pending = [
                (pname, value, issue)
                for (ptype, pname, value), issue in PENDING_VALUES.items()
                if ptype == spec.type and params.get(pname) == value
            ]
            for pname, value, issue in pending:
                problems.append(
                    Problem(
                        (*where, "parameters", pname),
                        f"{pname}: {value} is pending: built in issue {issue}",
                    )
                )
            notes.extend(ignored_notes(_ignored_reasons(spec.type), params))
            try:
                if not pending:
                    registry.build(spec.type, params, where)
            except ConfigError as exc:
                message = exc.message
                if message == "unknown field" and isinstance(exc.path[-1], str):
                    fields = [
                        f.encode_name
                        for f in msgspec.structs.fields(registry.get(spec.type).Params)
                    ]
                    message += did_you_mean(exc.path[-1], fields)
                problems.append(Problem(exc.path, message))
            out.append((name, PluginSpec(type=spec.type, name=name, parameters=params)))
        elif spec.type in foreign:
            kind, how = "implemented", "implemented by flow control (docs/flow-control.md)"
            # Flow control decodes the parameters itself (strictly); the ones it accepts
            # without acting on are said here, with the scheduling plugins' ones.
            notes.extend(ignored_notes(_ignored_reasons(spec.type), params))
            out.append((name, PluginSpec(type=spec.type, name=name, parameters=params or None)))
        elif spec.type in MAPPED:
            mapped = MAPPED[spec.type]
            kind, how = "mapped", f"mapped to {mapped.how}"
            decoded = _decode(params, mapped.params, (*where, "parameters"), problems)
            if decoded is not None:
                notes.extend(ignored_notes(mapped.ignored, params))
            if decoded is not None and mapped.effect is not None:
                try:
                    plumbing, extra = mapped.effect(decoded)
                except ValueError as exc:
                    problems.append(Problem((*where, "parameters"), str(exc)))
                else:
                    t.plumbing = t.plumbing.merge(plumbing)
                    notes.extend(extra)
            stand_in = (
                PluginSpec(type=mapped.scheduling_type, name=name)
                if mapped.scheduling_type
                else None
            )
            out.append((name, stand_in))
        elif spec.type in PENDING_TYPES:
            kind = "pending"
            how = f"pending: built in issue {PENDING_TYPES[spec.type]}"
            problems.append(Problem((*where, "type"), f"plugin type {spec.type!r} is {how}"))
            out.append((name, None))
        elif spec.type in REFUSED:
            kind, how = "refused", f"refused: {REFUSED[spec.type]}"
            problems.append(Problem((*where, "type"), f"plugin type {spec.type!r} {how}"))
            out.append((name, None))
        elif spec.type in LLMD_TYPES:
            kind, how = "refused", "refused: an llm-d plugin type extproc does not implement"
            problems.append(Problem((*where, "type"), f"plugin type {spec.type!r} {how}"))
            out.append((name, None))
        else:
            kind, how = "unknown", "unknown"
            problems.append(
                Problem(
                    (*where, "type"),
                    f"unknown plugin type {spec.type!r}" + did_you_mean(spec.type, known),
                )
            )
            out.append((name, None))
        t.realised.append(Realised(name, spec.type, kind, how, tuple(notes)))
    for spec in implicit:
        if spec.name in seen:
            continue
        out.append((spec.name or spec.type, spec))
        t.realised.append(
            Realised(spec.name or spec.type, spec.type, "implemented", "implemented (implicit)")
        )
    return out


# Endpoint attributes extproc produces, and the llm-d plugin types that produce them.
ATTRIBUTE_PRODUCERS = {"GPUUtilization": ("dcgm-data-source", "dcgm-extractor")}


def _check_attributes(
    raw: Any, specs: list[tuple[str, PluginSpec | None]], problems: list[Problem]
) -> None:
    """An endpoint-attribute plugin must read an attribute something in this config
    produces; otherwise it would see every endpoint as missing it, silently."""
    if not isinstance(raw, list):
        return
    raw_types = [item.get("type") for item in raw if isinstance(item, dict)]
    types = {s.type for _, s in specs if s is not None} | {
        t for t in raw_types if isinstance(t, str)
    }
    fields = {"endpoint-attribute-filter": "attribute", "endpoint-attribute-scorer": "attributeKey"}
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            continue
        field_name = fields.get(item["type"])
        params = item.get("parameters")
        if field_name is None or not isinstance(params, dict):
            continue
        attribute = params.get(field_name)
        if not isinstance(attribute, str):
            continue
        where: Path = ("plugins", i, "parameters", field_name)
        producers = ATTRIBUTE_PRODUCERS.get(attribute)
        if producers is None:
            problems.append(
                Problem(
                    where,
                    f"no producer of attribute {attribute!r} in extproc (it produces: "
                    f"{', '.join(ATTRIBUTE_PRODUCERS)})"
                    + did_you_mean(attribute, ATTRIBUTE_PRODUCERS),
                )
            )
        elif not types & set(producers):
            problems.append(
                Problem(where, f"attribute {attribute!r} needs a {producers[0]} plugin")
            )


def _with_labels(spec: PluginSpec, labels: dict[str, str]) -> PluginSpec:
    params = {**(spec.parameters or {}), "levelLabels": labels}
    return PluginSpec(type=spec.type, name=spec.name, parameters=params)


def _check_refs(refs: Iterable[tuple[Path, str]], names: set[str], problems: list[Problem]) -> None:
    for path, ref in refs:
        if ref not in names:
            problems.append(Problem(path, f"no plugin named {ref!r}" + did_you_mean(ref, names)))


def _sections(doc: dict, specs: list[tuple[str, PluginSpec | None]], t: Translation) -> None:
    problems = t.problems
    names = {n for n, _ in specs}
    gates = doc.get("featureGates")
    if gates is not None:
        decoded = _decode(gates, list[str], ("featureGates",), problems) or []
        for i, gate in enumerate(decoded):
            if gate in PENDING_FEATURE_GATES:
                problems.append(
                    Problem(
                        ("featureGates", i),
                        f"feature gate {gate!r} is pending: built in issue "
                        f"{PENDING_FEATURE_GATES[gate]}",
                    )
                )
            elif gate not in KNOWN_FEATURE_GATES:
                problems.append(
                    Problem(
                        ("featureGates", i),
                        f"unknown feature gate {gate!r}" + did_you_mean(gate, KNOWN_FEATURE_GATES),
                    )
                )
            elif gate == "flowControl":
                t.notes.append(
                    "feature gate flowControl: flow control is on when the config has a "
                    "flowControl or saturationDetector section or an admitter plugin"
                )
            else:
                t.notes.append(f"feature gate {gate}: nothing to turn on (always on in extproc)")
    if "dataLayer" in doc:
        dl = _decode(doc["dataLayer"], shape.DataLayerConfig, ("dataLayer",), problems)
        if dl is not None:
            refs: list[tuple[Path, str]] = []
            for i, src in enumerate(dl.sources):
                refs.append((("dataLayer", "sources", i, "pluginRef"), src.pluginRef))
                for j, ex in enumerate(src.extractors):
                    refs.append(
                        (("dataLayer", "sources", i, "extractors", j, "pluginRef"), ex.pluginRef)
                    )
            for key in ("discovery", "peerDiscovery"):
                ref = getattr(dl, key)
                if ref is not None and ref.pluginRef:
                    refs.append((("dataLayer", key, "pluginRef"), ref.pluginRef))
            if dl.crossReplicaSyncerPluginRef:
                refs.append(
                    (("dataLayer", "crossReplicaSyncerPluginRef"), dl.crossReplicaSyncerPluginRef)
                )
            _check_refs(refs, names, problems)
            if dl.injectDefaults is False:
                t.notes.append(
                    "dataLayer.injectDefaults: false ignored: extproc scrapes each endpoint's "
                    "metrics unless state.scrape is null"
                )
            if dl.crossReplicaSyncInterval is not None:
                # llm-d's period for syncing in-flight state across replicas is our in-flight
                # exchange's; extproc.config applies it unless state.shared_inflight says.
                try:
                    interval_s = parse_duration_s(dl.crossReplicaSyncInterval)
                except ValueError as exc:
                    problems.append(Problem(("dataLayer", "crossReplicaSyncInterval"), str(exc)))
                else:
                    if interval_s <= 0:
                        problems.append(
                            Problem(("dataLayer", "crossReplicaSyncInterval"), "must be positive")
                        )
                    else:
                        t.plumbing = t.plumbing.merge(
                            Plumbing(shared_inflight_interval_s=interval_s)
                        )
    parser_refs: list[tuple[Path, str]] = []
    if "requestHandler" in doc:
        rh = _decode(
            doc["requestHandler"], shape.RequestHandlerConfig, ("requestHandler",), problems
        )
        if rh is not None:
            parser_refs += [
                (("requestHandler", "parsers", i, "pluginRef"), p.pluginRef)
                for i, p in enumerate(rh.parsers)
            ]
    if "parser" in doc:
        p = _decode(doc["parser"], shape.PluginRefSpec, ("parser",), problems)
        if p is not None and p.pluginRef:
            parser_refs.append((("parser", "pluginRef"), p.pluginRef))
    _check_refs(parser_refs, names, problems)
    if "flowControl" in doc:
        fc = _decode(doc["flowControl"], shape.FlowControlConfig, ("flowControl",), problems)
        if fc is not None:
            _check_refs(
                [(("flowControl", *p), r) for p, r in shape.flow_control_refs(fc)], names, problems
            )
            if fc.noEndpointRequestTTL is not None:
                # Flow control also logs it at start; check-config says it before that.
                t.notes.append(
                    "flowControl.noEndpointRequestTTL ignored: not implemented "
                    "(defaultRequestTTL bounds every queued request)"
                )
    if "saturationDetector" in doc:
        sd = _decode(
            doc["saturationDetector"],
            shape.SaturationDetectorConfig,
            ("saturationDetector",),
            problems,
        )
        if sd is not None and sd.pluginRef:
            _check_refs([(("saturationDetector", "pluginRef"), sd.pluginRef)], names, problems)
    for section, issue in PENDING_SECTIONS.items():
        if doc.get(section):
            problems.append(
                Problem((section,), f"the {section} section is pending: built in issue {issue}")
            )


def _profiles(
    raw: Any,
    specs: list[tuple[str, PluginSpec | None]],
    names: set[str],
    failed: set[str],
    problems: list[Problem],
) -> list[ProfileSpec]:
    """The profiles, refs checked; refs to plugins already reported are not reported again."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        problems.append(Problem(("schedulingProfiles",), "expected a list"))
        return []
    scheduling = {n for n, s in specs if s is not None}
    out = []
    for p, item in enumerate(raw):
        where: Path = ("schedulingProfiles", p)
        prof = _decode(item, ProfileSpec, where, problems)
        if prof is None:
            continue
        refs: list[PluginRef] = []
        for r, ref in enumerate(prof.plugins):
            at: Path = (*where, "plugins", r)
            if ref.pluginRef not in names:
                problems.append(
                    Problem(
                        (*at, "pluginRef"),
                        f"no plugin named {ref.pluginRef!r}" + did_you_mean(ref.pluginRef, names),
                    )
                )
            elif ref.pluginRef in failed:
                pass
            elif ref.pluginRef not in scheduling:
                problems.append(
                    Problem(
                        (*at, "pluginRef"),
                        f"{ref.pluginRef!r} is data plumbing, not a filter, scorer or picker",
                    )
                )
            elif ref.weight is not None and ref.weight <= 0:
                problems.append(Problem((*at, "weight"), "must be positive"))
            refs.append(ref)
        out.append(ProfileSpec(name=prof.name, plugins=refs))
    return out
