"""Every plugin type extproc registers is named in its doc, every parameter it accepts is
named there with its type, and every default the docs give is the code's.

The types and their parameters come from the registries themselves, so a new plugin or a new
parameter is covered without editing this file: the scheduling plugin registry (its
built-ins; docs/plugins.md), flow control's plugins (`FLOW_PLUGINS`; docs/flow-control.md)
and llm-d's mapped types (`MAPPED`, whose parameters configure extproc's own machinery;
docs/llm-d.md). A plugin's parameters are the fields of its `Params` struct as YAML spells
them; a field holding a struct (or a list of them) adds its fields as dotted paths
(`profiles.decode`), a struct met again inside itself (a decision tree) once.

A parameter counts as named where a parameter table (PARAM_HEADER) has a row for it, or where
a paragraph, list item or table row naming its type in code (or under a heading naming it)
names it in code, by its dotted path, a tail of it, or as a key `name: value`.

Defaults are checked wherever the docs give one: every row of a parameter table (for each
type of the row), and these ways of writing one in prose, in a block that names the type:
`name` (default V), `name` V or `name` (V) for a number, `name: V`, the default / (the
default, and `name: V` (opt-in), which says V is not the default. docs/plugins.md and
docs/flow-control.md have a table naming every parameter of their plugins.

And no doc calls a registered type not implemented (docs outliving the plugin's arrival).
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
import pytest
import yaml

from extproc.flowcontrol.config import FLOW_PLUGINS
from extproc.scheduling.llmd.mapped import MAPPED
from extproc.scheduling.plugins import BUILTINS
from extproc.scheduling.registry import PluginRegistry
from tests.docs.doc_texts import REQUIRED, code_spans, doc_texts, field_default, table_rows

PARAM_HEADER = ("type", "parameter", "default")


@dataclass(frozen=True)
class Family:
    """Plugin types from one registry, and the docs that document them (`docs[0]` names
    every type)."""

    docs: tuple[str, ...]
    params: Callable[[], dict[str, type[msgspec.Struct]]]
    complete_table: bool  # docs[0] has a parameter table naming every parameter
    # Whether a default given in prose is the parameter's own. Not for llm-d's mapped types:
    # unset, they leave extproc's setting as it is, and the docs give the setting's default.
    prose_defaults: bool = True


def _scheduling() -> dict[str, type[msgspec.Struct]]:
    # Built through the registry, so what is listed is what it accepts at start-up;
    # installed entry points are their own packages' to document.
    registry = PluginRegistry(BUILTINS)
    return {name: registry.get(name).Params for name in registry.type_names}


FAMILIES = {
    "scheduling": Family(
        ("plugins.md", "latency.md", "llm-d.md"), _scheduling, complete_table=True
    ),
    "flow control": Family(
        ("flow-control.md",),
        lambda: {c.type_name: c.Params for c in FLOW_PLUGINS},
        complete_table=True,
    ),
    "llm-d mapped": Family(
        ("llm-d.md",),
        lambda: {name: m.params for name, m in MAPPED.items()},
        complete_table=False,
        prose_defaults=False,
    ),
}

UNCHECKED = object()  # a default the docs give in words


def _structs(tp: Any) -> list[type[msgspec.Struct]]:
    """The msgspec Structs a field's type holds (optional, in a list, or a dict's value)."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return [tp]
    return [s for arg in typing.get_args(tp) for s in _structs(arg)]


def _walk(
    cls: type[msgspec.Struct], path: tuple[str, ...], seen: frozenset[type]
) -> Iterator[tuple[str, Any, bool]]:
    """(dotted path, default, holds a struct) of every parameter of `cls`."""
    hints = typing.get_type_hints(cls, include_extras=True)
    defaults = {f.name: field_default(f) for f in msgspec.structs.fields(cls)}
    for f in msgspec.structs.fields(cls):
        here = (*path, f.encode_name)
        inner = [s for s in _structs(hints[f.name]) if s not in seen]
        yield ".".join(here), defaults[f.name], bool(_structs(hints[f.name]))
        for struct in inner:
            yield from _walk(struct, here, seen | {struct})


@cache
def parameters() -> dict[tuple[str, str], dict[str, tuple[Any, bool]]]:
    """(family, type) -> parameter path -> (default, holds a struct)."""
    return {
        (fam, name): {p: (d, s) for p, d, s in _walk(params, (), frozenset({params}))}
        for fam, family in FAMILIES.items()
        for name, params in family.params().items()
    }


ALL_TYPES = frozenset(name for _, name in parameters())

# -- what the docs say ------------------------------------------------------------------

IDENT = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?:\.[A-Za-z][A-Za-z0-9_]*)*")


def _blocks(text: str) -> Iterator[tuple[str, str]]:
    """(heading, block) of every paragraph, list item and table row, fenced code left out."""
    heading = ""
    for part in re.split(r"(^#{1,6} .*$)", text, flags=re.MULTILINE):
        if re.match(r"#{1,6} ", part):
            heading = part
            continue
        part = re.sub(r"^```.*?^```", "", part, flags=re.MULTILINE | re.DOTALL)
        for paragraph in re.split(r"\n\s*\n", part):
            for block in re.split(r"\n(?=\s*(?:[-*] |\d+\. |\|))", paragraph):
                yield heading, re.sub(r"\s+", " ", block)


def _types_named(text: str) -> set[str]:
    return {span.strip() for span in code_spans(text)} & ALL_TYPES


def _names_in(block: str) -> set[str]:
    """Parameter names a block gives in code: `name`, `a.b.c`, `name: value`."""
    names = set()
    for span in code_spans(block):
        key = re.match(r"\s*([A-Za-z][\w.]*)\s*:", span)
        if key:
            names.add(key[1])
        if IDENT.fullmatch(span.strip()):
            names.add(span.strip())
    return names


def _is_named(path: str, names: set[str]) -> bool:
    """Named by its dotted path or a tail of it, or (a mapping) by a key under it
    (`kvEventsConfig.zmqEndpoint`)."""
    parts = path.split(".")
    return any(".".join(parts[i:]) in names for i in range(len(parts))) or any(
        n.startswith(path + ".") for n in names
    )


@dataclass(frozen=True)
class Said:
    """A default the docs give: `value` is (or, `negated`, is not) the default of `param`
    of the types in `types`."""

    doc: str
    types: frozenset[str]
    param: str
    value: Any
    negated: bool = False
    table: bool = False  # a table row's default holds for every type of the row


NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"
PROSE_DEFAULTS = (
    (
        re.compile(
            rf"`([A-Za-z][\w.]*)`(?: [a-z]+){{0,2}},? \(?default:? "
            rf"(?:`([^`]+)`|({NUMBER}|true|false)\b)(?![.%/-])"
        ),
        False,
    ),
    (re.compile(rf"`([A-Za-z][\w.]*)` \(?({NUMBER})(?![\w.%/-])"), False),
    # "the default before" / "by default before ..." say what it was, not what it is
    (re.compile(r"`([A-Za-z][\w.]*): ([^`]+)`,? \(?(?:the|by) default\b(?! before)"), False),
    (re.compile(r"`([A-Za-z][\w.]*): ([^`]+)`,? \(opt-in\b"), True),
    (re.compile(r"\b[Bb]y default,? `([A-Za-z][\w.]*): ([^`]+)`"), False),
)


def _value(text: str) -> Any:
    text = text.strip()
    if text in ("none", "required"):
        return {"none": None, "required": REQUIRED}[text]
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


@cache
def documented(family: str) -> tuple[dict[str, set[str]], list[Said], set[str]]:
    """(type -> parameter names documented with it, the defaults the docs give, the types
    the family's first doc names)."""
    fam = FAMILIES[family]
    types = {name for f, name in parameters() if f == family}
    named: dict[str, set[str]] = {t: set() for t in types}
    said: list[Said] = []
    for doc in fam.docs:
        text = doc_texts()[doc]
        for cells in table_rows(text, PARAM_HEADER):
            ts = _types_named(cells[0]) & types
            for t in ts:
                named[t] |= set(code_spans(cells[1]))
            params = code_spans(cells[1])
            said += [
                Said(doc, frozenset(ts), p, d, table=True)
                for p, d in zip(params, _table_defaults(cells[2], len(params)), strict=True)
            ]
        for heading, block in _blocks(text):
            if (
                block.lstrip().startswith("|")
                and tuple(c.strip() for c in block.strip().strip("|").split("|")[:3])
                == PARAM_HEADER
            ):
                continue
            ts = (_types_named(block) | _types_named(heading)) & types
            if not ts:
                continue
            names = _names_in(block)
            for t in ts:
                named[t] |= names
            for pattern, negated in PROSE_DEFAULTS if fam.prose_defaults else ():
                for m in pattern.finditer(block):
                    value = next(g for g in m.groups()[1:] if g is not None)
                    said.append(Said(doc, frozenset(ts), m[1], _value(value), negated))
    first = {t for _, block in _blocks(doc_texts()[fam.docs[0]]) for t in _types_named(block)}
    return named, said, first


def _table_defaults(cell: str, n: int) -> list[Any]:
    """The defaults a table cell gives for a row of `n` parameters: one for all (`1`, none,
    required), or one per parameter in order (`0.8`, `0.2`); other words are not checked."""
    spans = code_spans(cell)
    if len(spans) == n > 1 and re.fullmatch(r"`[^`]*`(?:, `[^`]*`)*", cell.strip()):
        return [yaml.safe_load(s) for s in spans]
    if len(spans) == 1 and cell.strip() == f"`{spans[0]}`":
        return [yaml.safe_load(spans[0])] * n
    if cell.strip() in ("none", "required"):
        return [_value(cell)] * n
    return [UNCHECKED] * n  # words: a value the code computes, or a struct's defaults


def _same(doc: Any, code: Any) -> bool:
    if doc is UNCHECKED:
        return True
    if isinstance(code, tuple):
        code = list(code)
    if isinstance(code, msgspec.Struct):
        return doc == msgspec.to_builtins(code)
    if isinstance(doc, bool) or isinstance(code, bool):
        return doc is code  # 1 is no `true`
    return bool(doc == code)


# -- the tests ------------------------------------------------------------------------


def test_the_registries_are_read():
    params = parameters()
    assert ("scheduling", "predicted-ttft-scorer") in params
    assert "epsilon" in params[("scheduling", "bounded-load-filter")]
    assert "profiles.decode" in params[("scheduling", "disagg-profile-handler")]
    tree = params[("scheduling", "decision-tree-filter")]
    assert "current.decisionTree" in tree and "current.decisionTree.current" not in tree
    assert ("flow control", "prefill-gate") in params
    assert ("llm-d mapped", "topology-extractor") in params
    assert sum(len(p) for p in params.values()) > 200


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_plugin_type_is_named(family: str):
    _, _, first = documented(family)
    types = sorted(name for f, name in parameters() if f == family)
    assert [t for t in types if t not in first] == [], FAMILIES[family].docs[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_parameter_is_named_with_its_type(family: str):
    named, _, _ = documented(family)
    missing = [
        f"{name}: {path}"
        for (f, name), params in parameters().items()
        if f == family
        for path, (_, holds_struct) in params.items()
        # a struct-valued parameter is named by its fields (`profiles.decode`)
        if not _is_named(path, named[name])
        and not (holds_struct and any(p.startswith(path + ".") for p in params))
    ]
    assert missing == []


@pytest.mark.parametrize("family", [f for f, fam in FAMILIES.items() if fam.complete_table])
def test_the_parameter_table_has_every_parameter(family: str):
    doc = FAMILIES[family].docs[0]
    rows = table_rows(doc_texts()[doc], PARAM_HEADER)
    in_table = {
        (t, p) for cells in rows for t in _types_named(cells[0]) for p in code_spans(cells[1])
    }
    missing = [
        f"{name}: {path}"
        for (f, name), params in parameters().items()
        if f == family
        for path, (_, holds_struct) in params.items()
        if (name, path) not in in_table
        and not (
            holds_struct and any((name, p) in in_table for p in params if p.startswith(path + "."))
        )
    ]
    unknown = [
        f"{t}: {p}" for t, p in sorted(in_table) if p not in parameters().get((family, t), {})
    ]
    assert (missing, unknown) == ([], [])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_defaults_the_docs_give_are_the_codes(family: str):
    _, said, _ = documented(family)
    wrong = []
    checked = 0
    for s in said:
        codes = {
            t: parameters()[(family, t)][s.param][0]
            for t in s.types
            if s.param in parameters()[(family, t)]
        }
        if not codes:
            continue  # a name that is no parameter of the types in view (a setting, a field)
        checked += 1
        # prose may name several types around one default; a table row speaks for each
        agreeing = [_same(s.value, code) != s.negated for code in codes.values()]
        agrees = all(agreeing) if s.table else any(agreeing)
        if not agrees:
            shown = ", ".join(f"{t} {v!r}" for t, v in sorted(codes.items()))
            verb = "is not" if s.negated else "is"
            wrong.append(f"{s.doc}: {s.param} {verb} {s.value!r} says the doc; code: {shown}")
    assert wrong == []
    assert checked > 0 or not FAMILIES[family].prose_defaults


NOT_THERE = re.compile(r"\bis not implemented\b|\bunknown plugin type\b|\bnot (?:yet )?built\b")


def test_no_doc_calls_a_registered_plugin_missing():
    """A type that was built after the docs called it missing (`latency-slo-admitter` in
    docs/flow-control.md) is not left described so."""
    wrong = []
    for doc, text in doc_texts().items():
        for _, block in _blocks(text):
            for sentence in re.split(r"(?<=[.;:])\s+", block):
                if NOT_THERE.search(sentence) and _types_named(sentence):
                    wrong.append(f"{doc}: {sentence.strip()[:160]}")
    assert wrong == []


def _typed_entries(node: Any) -> Iterator[dict[str, Any]]:
    """Every mapping with a string `type` in a YAML document (plugin entries)."""
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            yield node
        for value in node.values():
            yield from _typed_entries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _typed_entries(item)


def test_every_yaml_example_decodes_into_its_plugins_params():
    """The YAML examples of the docs and of the plugins' own docstrings (which `extproc
    plugins` prints) configure each plugin as its Params accept: a renamed or misspelt
    parameter in an example is a failure here, not a user's config error."""
    params = {name: p for (_, name), p in _params_classes().items()}
    texts = dict(doc_texts())
    registry = PluginRegistry(BUILTINS)
    texts |= {f"{name} (docstring)": doc for name, doc in registry.describe()}
    wrong, seen = [], 0
    for where, text in texts.items():
        for block in re.findall(r"```ya?ml\n(.*?)^ *```", text, re.MULTILINE | re.DOTALL):
            try:
                loaded = yaml.safe_load(block)
            except yaml.YAMLError:
                continue  # a fragment with placeholders
            for entry in _typed_entries(loaded):
                if entry["type"] not in params:
                    continue  # a type of another registry or none (`type: threshold`)
                seen += 1
                try:
                    msgspec.convert(entry.get("parameters") or {}, params[entry["type"]])
                except (msgspec.ValidationError, ValueError) as exc:
                    wrong.append(f"{where}: {entry['type']}: {exc}")
    assert wrong == []
    assert seen > 50


def test_the_tables_call_ignored_exactly_what_check_config_notes():
    """A parameter-table row that calls a parameter ignored (or accepted, not acted on) names
    a pair check-config notes (llm-d's IGNORED_PARAMS), and every noted pair is said so in
    its table: the docs and the notes cannot tell a user different things."""
    from extproc.scheduling.llmd.table import IGNORED_PARAMS

    texts = doc_texts()
    said: set[tuple[str, str]] = set()
    for doc in ("plugins.md", "flow-control.md"):
        for row in table_rows(texts[doc], PARAM_HEADER):
            if "ignored" in row[3] or "not acted on" in row[3]:
                said |= {(t, p) for t in code_spans(row[0]) for p in code_spans(row[1])}
    assert sorted(said - set(IGNORED_PARAMS)) == []
    assert sorted(set(IGNORED_PARAMS) - said) == []


@cache
def _params_classes() -> dict[tuple[str, str], type[msgspec.Struct]]:
    return {
        (fam, name): p for fam, family in FAMILIES.items() for name, p in family.params().items()
    }
