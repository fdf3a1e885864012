"""A settings document (ours, or a bare llm-d EndpointPickerConfig) examined in one pass:
every problem collected, the scheduling section translated (`scheduling.llmd.translate`),
and the data plumbing its llm-d plugins imply applied to the Settings tree.

`config.load_settings` / `decode_settings` and `extproc check-config` all go through
`examine`, so serving and checking validate the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from extproc.errors import ConfigError
from extproc.hashing.tokenizer import PreciseSettings
from extproc.scheduling.llmd.mapped import Plumbing
from extproc.scheduling.llmd.translate import Translation, translate
from extproc.scheduling.registry import PluginRegistry, validation_error

if TYPE_CHECKING:
    from extproc.config import Settings


@dataclass(slots=True)
class Examined:
    """`settings` is None when there are problems. `degraded` lists what runs with less than
    the config asked for (e.g. no local tokenizer: approximate prefix keys), each said at
    start-up by `serve` and counted in `extproc_llmd_degraded`."""

    settings: Settings | None
    problems: list[ConfigError] = field(default_factory=list)
    translation: Translation | None = None
    wrapped: bool = False
    notes: list[str] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)


def find_tokenizer(model: str, dirs: list[str]) -> Path | None:
    """A local folder holding `model`'s tokenizer.json: `<dir>/<model>`, the Hugging Face
    cache layout `<dir>/models--org--name/snapshots/*`, or `<dir>/<name>`. Never downloads."""
    if not model:
        return None
    name = model.rsplit("/", 1)[-1]
    for d in dirs:
        root = Path(d).expanduser()
        for candidate in (root / model, root / name):
            if (candidate / "tokenizer.json").is_file():
                return candidate
        snapshots = root / ("models--" + model.replace("/", "--")) / "snapshots"
        if snapshots.is_dir():
            for snap in sorted(snapshots.iterdir()):
                if (snap / "tokenizer.json").is_file():
                    return snap
    return None


def apply_plumbing(settings: Settings, plumbing: Plumbing, ex: Examined) -> Settings:
    """The settings changes llm-d's data-plumbing plugins imply. Settings the user wrote in
    our own sections win over what a plugin implies only for `parse.precise`."""
    from extproc.config import KVEventSettings

    parse, index, state, discovery = (
        settings.parse,
        settings.index,
        settings.state,
        settings.discovery,
    )
    mode = plumbing.index_mode
    if mode == "precise" and parse.precise is None:
        model = plumbing.precise_model or ""
        found = find_tokenizer(model, settings.tokenizer_dirs)
        if found is None:
            why = (
                "no model name (token-producer modelName)"
                if not model
                else (
                    f"no local tokenizer for model {model!r} (looked in "
                    f"{', '.join(settings.tokenizer_dirs)})"
                )
            )
            ex.degraded.append(
                f"precise prefix cache: {why}; prefix matching uses approximate keys from "
                "routing decisions instead"
            )
            mode = "approximate"
        else:
            parse = msgspec.structs.replace(
                parse,
                precise=PreciseSettings(
                    tokenizer_dir=str(found),
                    model=model,
                    block_size=plumbing.precise_block_size or 16,
                ),
            )
            ex.notes.append(f"precise tokenizer for {model!r}: {found}")
    if mode == "precise" and parse.precise is not None and index.kv_events is None:
        bind = plumbing.kv_events_bind or "tcp://*:5557"
        index = msgspec.structs.replace(index, kv_events=KVEventSettings(bind=bind))
        ex.notes.append(f"KV events: subscriber binds {bind} (vLLM publishes to it)")
    if mode == "approximate" and index.kv_events is None:
        index = msgspec.structs.replace(index, record_decisions=True)
    if plumbing.block_tokens:
        parse = msgspec.structs.replace(parse, block_tokens=plumbing.block_tokens)
    elif plumbing.block_chars:
        # extproc's approximate blocks are bytes_per_token bytes per token.
        tokens = max(1, round(plumbing.block_chars / parse.bytes_per_token))
        parse = msgspec.structs.replace(parse, block_tokens=tokens)
    if plumbing.max_prefix_blocks:
        parse = msgspec.structs.replace(parse, max_blocks=plumbing.max_prefix_blocks)
    elif plumbing.max_prefix_tokens:
        blocks = math.ceil(plumbing.max_prefix_tokens / parse.block_tokens)
        parse = msgspec.structs.replace(parse, max_blocks=max(1, blocks))
    if plumbing.capacity_blocks:
        index = msgspec.structs.replace(index, capacity_blocks=plumbing.capacity_blocks)
    if state.scrape is not None:
        changes: dict[str, Any] = {}
        if plumbing.scrape_scheme:
            changes["scheme"] = plumbing.scrape_scheme
        if plumbing.scrape_path:
            changes["path"] = plumbing.scrape_path
        if plumbing.scrape_interval_s:
            changes["interval_s"] = plumbing.scrape_interval_s
        if changes:
            state = msgspec.structs.replace(
                state, scrape=msgspec.structs.replace(state.scrape, **changes)
            )
    if plumbing.endpoints_file and discovery.endpoints_file is None:
        discovery = msgspec.structs.replace(discovery, endpoints_file=plumbing.endpoints_file)
    return msgspec.structs.replace(
        settings, parse=parse, index=index, state=state, discovery=discovery
    )


def examine(doc: Any) -> Examined:
    """Decode, translate and validate a parsed YAML document, collecting every problem."""
    from extproc.config import Settings, build_configured_scheduler

    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        return Examined(None, [ConfigError("expected a mapping at the top level")])
    bare = doc.get("kind") == "EndpointPickerConfig" or (
        "scheduling" not in doc and ("plugins" in doc or "schedulingProfiles" in doc)
    )
    wrapped = not bare
    raw_sched = doc.get("scheduling") if wrapped else doc
    rest = {k: v for k, v in doc.items() if k != "scheduling"} if wrapped else {}
    ex = Examined(None, wrapped=wrapped)
    try:
        settings = msgspec.convert(rest, Settings)
    except msgspec.ValidationError as exc:
        ex.problems.append(validation_error(exc, ()))
        settings = None
    if raw_sched is None:
        if settings is not None:
            try:
                build_configured_scheduler(settings)
            except ConfigError as exc:
                ex.problems.append(exc)
        ex.settings = None if ex.problems else settings
        return ex
    disabled = settings.disabled_plugins if settings is not None else []
    registry = PluginRegistry.default(disabled=disabled)
    t = translate(raw_sched, registry)
    ex.translation = t
    ex.notes.extend(t.notes)
    ex.problems.extend(ConfigError(p.message, path=("scheduling", *p.path)) for p in t.problems)
    if ex.problems or settings is None or t.config is None:
        return ex
    settings = msgspec.structs.replace(settings, scheduling=t.config)
    settings = apply_plumbing(settings, t.plumbing, ex)
    try:
        build_configured_scheduler(settings)
    except ConfigError as exc:
        ex.problems.append(exc)
        return ex
    if ex.degraded:
        settings = msgspec.structs.replace(settings, degraded=list(ex.degraded))
    ex.settings = settings
    return ex


def check_report(path: str | Path) -> tuple[str, int]:
    """`extproc check-config`: every problem with file:line, how each llm-d plugin is
    realised, what runs degraded; exit code 0 (serves as is) or 2 (it would not)."""
    from extproc.config import build_configured_scheduler, locate, read_document

    try:
        text, doc = read_document(path)
    except ConfigError as exc:
        return f"{exc}\n", 2
    ex = examine(doc)
    out: list[str] = []
    if ex.problems:
        out.append(f"{path}: {len(ex.problems)} problem(s)")
        out.extend(f"  {locate(path, text, p, bare=not ex.wrapped)}" for p in ex.problems)
    else:
        out.append(f"{path}: OK")
    if ex.translation and ex.translation.realised:
        out.append("plugins:")
        for r in ex.translation.realised:
            label = r.name if r.name == r.type else f"{r.name} ({r.type})"
            out.append(f"  {label}: {r.how}")
            out.extend(f"    - {n}" for n in r.notes)
    for note in ex.notes:
        out.append(f"note: {note}")
    for d in ex.degraded:
        out.append(f"DEGRADED: {d}")
    if ex.settings is not None:
        out.append("profiles:")
        scheduler = build_configured_scheduler(ex.settings)
        for name, profile in scheduler.profiles.items():
            scorers = ", ".join(f"{s.name} x{s.weight:g}" for s in profile.scorers) or "none"
            filters = ", ".join(f.name for f in profile.filters) or "none"
            out.append(
                f"  profile {name}: filters [{filters}], scorers [{scorers}], "
                f"picker {profile.picker.type_name}"
            )
    return "\n".join(out) + "\n", 2 if ex.problems else 0
