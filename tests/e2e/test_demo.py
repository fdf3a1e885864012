"""`extproc demo` end to end, tiny: three policies through a real Envoy and simulated vLLM
servers; extproc must beat round-robin on hit ratio and leave no process behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

from extproc.demo import run_demo


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


def test_tiny_demo_prints_sane_table(capsys, tmp_path):
    before = _children()
    rc = run_demo(requests=48, upstreams=2, rate=24, chart=str(tmp_path / "demo.png"))
    out = capsys.readouterr().out
    print(out)  # captured again: `pytest -rP` shows a passing run's table
    rows = {}
    for line in out.splitlines():
        m = re.match(
            r"(round-robin|extproc approximate|extproc precise)\s+([\d.]+)%\s+([\d.]+)ms\s+"
            r"([\d.]+)ms\s+([\d.]+)\s+(\d+)\s+(\d+)/(\d+)",
            line,
        )
        if m:
            rows[m[1]] = [float(x) for x in m.groups()[1:]]
    assert set(rows) == {"round-robin", "extproc approximate", "extproc precise"}, out
    for hit, p50, p90, req_s, _tok_s, ok, total in rows.values():
        assert 0 <= hit <= 100 and 0 < p50 <= p90 and req_s > 0
        assert ok == total == 48
    assert rows["extproc approximate"][0] > rows["round-robin"][0]
    assert rows["extproc precise"][0] > rows["round-robin"][0]
    assert rc == 0
    assert "x10" in out  # the time compression is stated
    assert "chart" in out
    assert _children() - before == set()
