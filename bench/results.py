"""bench/RESULTS.md writing shared by the benchmarks: one `## ` section per benchmark,
replaced in place, and its markdown tables."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path


def table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[object]]) -> list[str]:
    """Markdown table lines: `columns` are (title, "l" or "r" alignment), each row one cell
    per column, already formatted."""
    align = {"l": "---", "r": "---:"}
    out = [
        "| " + " | ".join(title for title, _ in columns) + " |",
        "|" + "|".join(align[a] for _, a in columns) + "|",
    ]
    out += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return out


def write_section(path: Path, section: str) -> None:
    """Replace (or append) the section with the same `## ` title; the rest is untouched."""
    title = section.split("\n", 1)[0]
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find(title)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        # One blank line before the next section, as when it was appended.
        rest = "\n" + text[end + 1 :] if end != -1 else ""
        text = text[:start] + section.rstrip("\n") + "\n" + rest
    path.write_text(text)
