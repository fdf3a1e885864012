"""bench/results.py: the RESULTS.md section writer and table helper the benchmarks share."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_results", ROOT / "bench" / "results.py")
assert _spec is not None and _spec.loader is not None
results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)


def test_table_aligns_and_formats_rows():
    lines = results.table([("a", "l"), ("b", "r")], [("x", 1), ("y", 2.5)])
    assert lines == ["| a | b |", "|---|---:|", "| x | 1 |", "| y | 2.5 |"]


def test_a_section_is_replaced_in_place_and_others_kept(tmp_path: Path):
    path = tmp_path / "RESULTS.md"
    results.write_section(path, "## One\n\nfirst\n")
    results.write_section(path, "## Two\n\nsecond\n")
    results.write_section(path, "## One\n\nagain\n")
    text = path.read_text()
    assert text == "# Benchmark results\n\n## One\n\nagain\n\n## Two\n\nsecond\n"
