"""Every field of the settings YAML (extproc/config.py's `Settings` and the structs under it,
flow control's section included) is named in the docs, and docs/flow-control.md's option
table gives the defaults the code has.

A field counts as documented where a doc names it as the YAML has it, in one of the ways the
docs write options: its dotted path or a tail of it of two names or more in code
(`state.scrape.interval_s`, `scrape.interval_s`); its name in code in the same paragraph,
list item or table row as its parent's (`state.dcgm`: `port` 9400, `path`, ...); a key of
a YAML example placed under its parents; a row of an option table that belongs to its
section (OPTION_TABLES).
"""

from __future__ import annotations

import re
import typing
from collections.abc import Iterator
from functools import cache
from typing import Any

import msgspec
import pytest
import yaml

from extproc.config import Settings
from tests.docs.doc_texts import REQUIRED, code_spans, doc_texts, field_default, table_rows

Path = tuple[str, ...]

# Fields not walked into, with the reason.
NOT_WALKED = {
    "scheduling": "llm-d's EndpointPickerConfig: its plugins are documented by type "
    "(docs/plugins.md, docs/llm-d.md; `extproc plugins` prints each one's parameters)",
}
# Fields that are no option, with the reason.
NOT_OPTIONS = {
    "degraded": "set by the config loader (what runs with less than asked for), not written",
}
# Option tables: (doc, header) -> the section whose fields its first column names (one or
# more in a row, their defaults in the second column in the same order).
OPTION_TABLES = {
    ("operations.md", ("option", "default", "meaning")): (),
    ("flow-control.md", ("key", "default", "meaning")): ("flow_control",),
}
# Tables that name every field of their section, none left out.
COMPLETE = {("flow-control.md", ("key", "default", "meaning"))}

IDENT = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)*")


def _structs(tp: Any) -> list[type[msgspec.Struct]]:
    """The msgspec Structs a field's type holds (optional, in a list, tuple or dict value)."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return [tp]
    return [s for arg in typing.get_args(tp) for s in _structs(arg)]


def _walk(cls: type[msgspec.Struct], path: Path) -> Iterator[tuple[Path, msgspec.inspect.Field]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in msgspec.inspect.type_info(cls).fields:
        here = (*path, f.encode_name)
        yield here, f
        if ".".join(here) in NOT_WALKED:
            continue
        for struct in _structs(hints[f.name]):
            yield from _walk(struct, here)


@cache
def options() -> dict[Path, msgspec.inspect.Field]:
    """Every field path of the settings YAML -> its field (default, default_factory)."""
    return {p: f for p, f in _walk(Settings, ()) if ".".join(p) not in NOT_OPTIONS}


def _blocks(text: str) -> Iterator[str]:
    """Paragraphs, list items and table rows (fenced code left out)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    for paragraph in re.split(r"\n\s*\n", text):
        yield from re.split(r"\n(?=\s*(?:[-*] |\d+\. |\|))", paragraph)


def _yaml_paths(node: Any, path: Path = ()) -> Iterator[Path]:
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str):
                yield (*path, key)
                yield from _yaml_paths(value, (*path, key))
    elif isinstance(node, list):
        for item in node:
            yield from _yaml_paths(item, path)


@cache
def documented() -> tuple[set[Path], list[tuple[set[str], set[str]]]]:
    """(dotted names and YAML key paths the docs give, and per block: its dotted names and
    its single names in code)."""
    dotted: set[Path] = set()
    blocks: list[tuple[set[str], set[str]]] = []
    for doc, text in doc_texts().items():
        for block in _blocks(text):
            names = {n for span in code_spans(block) for n in IDENT.findall(span)}
            blocks.append(({n for n in names if "." in n}, {n for n in names if "." not in n}))
            dotted |= {tuple(n.split(".")) for n in names if "." in n}
        for fenced in re.findall(r"^```ya?ml\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            try:
                dotted |= set(_yaml_paths(yaml.safe_load(fenced)))
            except yaml.YAMLError:
                continue
        for (table_doc, header), section in OPTION_TABLES.items():
            if table_doc == doc:
                for cells in table_rows(text, header):
                    dotted |= {(*section, key) for key in code_spans(cells[0])}
    return dotted, blocks


def _tails(path: Path, shortest: int) -> set[str]:
    return {".".join(path[i:]) for i in range(len(path) - shortest + 1)}


def is_documented(path: Path) -> bool:
    dotted, blocks = documented()
    if path in dotted or any(len(t) > 1 and path[-len(t) :] == t for t in dotted):
        return True
    if any(len(d) > len(path) and d[: len(path)] == path for d in dotted):
        return True  # a section named by its fields' paths (`parse.video.stride`)
    if len(path) == 1:  # a section or top-level list: its name in code anywhere
        return any(path[0] in single for _, single in blocks)
    parents = _tails(path[:-1], 1)
    return any(path[-1] in single and (parents & (d | single)) for d, single in blocks)


def test_the_walk_finds_the_options():
    paths = options()
    assert ("server", "max_body_bytes") in paths
    assert ("index", "kv_events", "curve_publisher_keys") in paths
    assert ("flow_control", "reserve_spike_joint") in paths
    assert ("parse", "image_estimators", "estimator", "kind") in paths  # in a tuple
    assert not any(p[0] == "scheduling" and len(p) > 1 for p in paths)
    assert len(paths) > 150


def test_every_option_is_documented():
    missing = [".".join(p) for p in options() if not is_documented(p)]
    assert missing == []


def test_documented_means_named_with_its_parent():
    """A field's name alone, in a paragraph naming no parent of it, does not count."""
    assert not is_documented(("state", "scrape", "no_such_option"))
    assert not is_documented(("server", "backend"))  # index.backend is documented, not this


ON = object()  # a section present by default


UNCHECKED = object()  # a default the table says in words (a list of built-in structs)


def _doc_defaults(cell: str) -> list[Any]:
    """The defaults a table cell gives, one per option of the row, as the tables write them:
    a YAML value in code (`256`, `{}`, `auto`), none, required, on (a section present by
    default)."""
    values: list[Any] = []
    for part in re.findall(r"`[^`]*`|[^,`]+", cell):
        part = part.strip()
        if not part:
            continue
        if part.startswith("`"):
            values.append(yaml.safe_load(part.strip("`")))
        elif part in ("none", "required", "on"):
            values.append({"none": None, "required": REQUIRED, "on": ON}[part])
        else:  # a bare number or boolean (256, 0.02, true); words are not checked
            value = yaml.safe_load(part)
            values.append(UNCHECKED if isinstance(value, str) else value)
    return values


def _matches(doc: Any, code: Any) -> bool:
    if doc is ON:
        return isinstance(code, msgspec.Struct)
    if doc is UNCHECKED:
        return isinstance(code, tuple) and all(isinstance(c, msgspec.Struct) for c in code)
    return doc == code


@pytest.mark.parametrize(("doc", "header"), list(OPTION_TABLES))
def test_option_tables_give_the_code_defaults(doc: str, header: tuple[str, ...]):
    section = OPTION_TABLES[(doc, header)]
    rows = table_rows(doc_texts()[doc], header)
    assert len(rows) > 20
    seen: set[Path] = set()
    wrong = []
    for cells in rows:
        keys = [(*section, *k.split(".")) for k in code_spans(cells[0])]
        defaults = _doc_defaults(cells[1])
        if len(defaults) == 1:  # one default for every option of the row
            defaults *= len(keys)
        assert len(keys) == len(defaults), cells[:2]
        for key, default in zip(keys, defaults, strict=True):
            if key not in options():
                wrong.append(f"{'.'.join(key)}: no such option")
            elif not _matches(default, field_default(options()[key])):
                wrong.append(f"{'.'.join(key)}: {default!r}, is {field_default(options()[key])!r}")
            seen.add(key)
    assert wrong == []
    if (doc, header) in COMPLETE:
        n = len(section)
        fields = {p for p in options() if len(p) == n + 1 and p[:n] == section}
        assert seen == fields, "the table's keys are the section's fields"
