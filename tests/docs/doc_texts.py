"""The user docs as the doc-sync tests read them: docs/*.md and README.md, by file name; and
a code default as the docs' tables write it."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[2]


@cache
def doc_texts() -> dict[str, str]:
    """File name -> text, for every user doc (docs/*.md, README.md)."""
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    return {p.name: p.read_text() for p in files}


def section(text: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of any level."""
    start = text.index(heading + "\n") + len(heading) + 1
    rest = re.search(r"^#{1,6} ", text[start:], re.MULTILINE)
    return text[start : start + rest.start()] if rest else text[start:]


def table_rows(text: str, header: tuple[str, ...]) -> list[list[str]]:
    """The cells of every row of the markdown tables whose header starts with `header`."""
    rows: list[list[str]] = []
    inside = False
    for line in text.splitlines():
        if not line.startswith("|"):
            inside = False
            continue
        cells = cells_of(line)
        if tuple(cells[: len(header)]) == header:
            inside = True
        elif inside and not set(cells[0]) <= {"-", ":"}:
            rows.append(cells)
    return rows


def cells_of(line: str) -> list[str]:
    """A table row's cells; a `|` inside a code span (`a|b`) does not split."""
    cells, cell, code = [], [], False
    for ch in line.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append("".join(cell).strip())
            cell = []
        else:
            cell.append(ch)
    return [*cells, "".join(cell).strip()]


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


REQUIRED = "required"  # a field without a default, as the tables say it


def field_default(f: msgspec.inspect.Field | msgspec.structs.FieldInfo) -> Any:
    """A struct field's default (its factory's value), or REQUIRED where it has none."""
    if f.default is not msgspec.NODEFAULT:
        return f.default
    if f.default_factory is not msgspec.NODEFAULT:
        return f.default_factory()
    return REQUIRED
