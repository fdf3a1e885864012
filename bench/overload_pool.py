"""Pool bench_overload.py runs of one configuration: interactive TTFT p99 over every admitted
interactive request of all its runs, against the p99 of every unloaded pass pooled. One
60 s run holds ~100 interactive requests, so its p99 is its slowest one or two; pooled over
three runs it is about the third slowest.

    .venv/bin/python bench/overload_pool.py out1.log out2.log ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from extproc.sim.workload import percentile


def main(paths: list[str]) -> int:
    hi: dict[str, list[float]] = {}
    engine: dict[str, list[float]] = {}
    goodput: dict[str, list[float]] = {}
    unloaded: list[float] = []
    unloaded_engine: list[float] = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if "unloaded_ttfts" in row:
                unloaded += row["unloaded_ttfts"]
                unloaded_engine += row.get("unloaded_engine_s", [])
            elif "hi_ttfts" in row:
                hi.setdefault(row["run"], []).extend(row["hi_ttfts"])
                engine.setdefault(row["run"], []).extend(row.get("hi_engine_s", []))
                goodput.setdefault(row["run"], []).append(row["steady_goodput_vs_capacity"])
    base = percentile(unloaded, 99)
    print(f"unloaded pooled: {len(unloaded)} requests, p50 {percentile(unloaded, 50):.3f} s, "
          f"p99 {base:.3f} s")  # fmt: skip
    for run, ttfts in hi.items():
        p99 = percentile(ttfts, 99)
        above = sum(1 for t in ttfts if t > 2 * base)
        print(f"{run}: {len(ttfts)} interactive, p50 {percentile(ttfts, 50):.3f} s, p95 "
              f"{percentile(ttfts, 95):.3f} s, p99 {p99:.3f} s = {p99 / base:.2f}x pooled "
              f"unloaded, {above} above 2x; steady goodput "
              f"{[round(g, 3) for g in goodput[run]]}")  # fmt: skip
        eng = engine.get(run)
        if eng and unloaded_engine:
            # The engine's part alone (KV + step wait + prefill, the sim's timing): free of
            # the machine's stalls outside the engine.
            ebase = percentile(unloaded_engine, 99)
            print(f"  engine part: p99 {percentile(eng, 99):.3f} s = "
                  f"{percentile(eng, 99) / ebase:.2f}x the unloaded engine p99 {ebase:.3f} s, "
                  f"{sum(1 for t in eng if t > 2 * ebase)} of {len(eng)} above 2x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
