"""docs/headers.md lists exactly the header names and metadata keys of extproc/protocol.py, and
no other module of the package spells an `x-...` header of the picker's own."""

from __future__ import annotations

import re
from pathlib import Path

from extproc import protocol

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "headers.md"


def protocol_names() -> dict[str, set[str]]:
    """Constant -> the header names it holds (a name, or a tuple of alternatives)."""
    out: dict[str, set[str]] = {}
    for const, value in vars(protocol).items():
        if not const.isupper() or not const.endswith(("_HEADER", "_HEADERS", "_KEY")):
            continue
        if const == "PICKER_OWNED_HEADERS":  # a set of names defined above it
            continue
        out[const] = {value} if isinstance(value, str) else set(value)
    return out


def doc_rows() -> dict[str, set[str]]:
    """Constant -> names, from the table rows."""
    rows: dict[str, set[str]] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`x-"):
            continue
        names = set(re.findall(r"`(x-[a-z0-9-]+)`", cells[0]))
        for const in re.findall(r"`([A-Z_]+)`", cells[1]):
            rows[const] = names
    return rows


def test_the_doc_table_matches_protocol():
    assert doc_rows() == protocol_names()


def test_no_module_spells_a_protocol_header_itself():
    names = {n for ns in protocol_names().values() for n in ns}
    pattern = re.compile(r"""["'](x-[a-z0-9-]+)["']""")
    found = []
    for path in sorted((ROOT / "extproc").rglob("*.py")):
        if path.name == "protocol.py" or "_proto" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name in pattern.findall(line):
                if name in names:
                    found.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert found == []
