"""One markdown row per run of bench/bench_overload.py output (the fourteenth session's
tables): steady goodput, interactive TTFT p50 / p99, p99 over the invocation's unloaded
p99 (requests above 2x), engine part p99 (over the unloaded engine p99), the engines' mean
KV use, the reserve kept and the refill credit (means, picker tokens), the slowest
interactive request (arrival s, tenant, TTFT, picker wait), worst share error, lost, the
sims' lanes (wall / scheduled step time over the burst; above ~1.1: a perturbed run) and
the 1-minute load average at the run's end.

    python bench/overload_rows.py <bench_overload.py output> [--slowest N]

`--slowest N`: after the rows, each run's N slowest interactive requests (arrival s,
tenant, TTFT, picker wait, engine KV wait / step wait / prefill, the server).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# The bench's own (nearest rank), so a row's engine p99 is computed as its TTFT p99 is.
from extproc.sim.workload import percentile


def slowest(rows: list[dict], n: int) -> None:
    for r in rows:
        print(f"{r['run'].removeprefix('flow control ')}, slowest {n}:")
        for t in sorted(r.get("hi_trace", []), key=lambda t: t["ttft"] or 0.0)[-n:][::-1]:
            kv, lane, pre = t.get("engine") or (0.0, 0.0, 0.0)
            print(f"  {t['at']:6.2f} s {t['tenant']}: {t['ttft']:.2f} s, picker "
                  f"{t.get('wait') or 0:.2f}, kv {kv:.2f}, step {lane:.2f}, prefill {pre:.2f} "
                  f"({t['endpoint']})")  # fmt: skip


def main() -> None:
    rows, base = [], {}
    n = int(sys.argv[sys.argv.index("--slowest") + 1]) if "--slowest" in sys.argv else 0
    for line in Path(sys.argv[1]).read_text().splitlines():
        if line.startswith('{"run"'):
            rows.append(json.loads(line))
        elif line.startswith('{"capacity'):
            base = json.loads(line)
    un = base.get("unloaded_ttft_p99", float("nan"))
    print(f"capacity {base.get('capacity_tok_s', 0):.0f} tok/s, unloaded p99 {un:.3f} s")
    for r in rows:
        ttfts = r.get("hi_ttfts", [])
        above = sum(1 for t in ttfts if t > 2 * un)
        eng = r.get("hi_engine_s", [])
        worst = max(r.get("hi_trace", []), key=lambda t: t["ttft"], default=None)
        slow = (f"{worst['at']:.2f} s {worst['tenant']}: {worst['ttft']:.2f} s "
                f"(picker {worst.get('wait', 0):.2f})") if worst else "-"  # fmt: skip
        share = max(abs(v) for v in r["share_error_vs_weight"].values())
        print(
            f"| {r['run'].removeprefix('flow control ')} | {r['steady_goodput_vs_capacity']:.3f} "
            f"| {r['hi_ttft_p50']:.3f} / {r['hi_ttft_p99']:.3f} "
            f"| {r['hi_ttft_p99'] / un:.2f}x ({above} of {len(ttfts)}) "
            f"| {percentile(eng, 99):.3f} | {r.get('tl_kv_mean')} "
            f"| {r.get('tl_reserved_mean')} / {r.get('tl_refill_mean')} | {slow} "
            f"| {share:.1%} | {r['lost']} | {r.get('lanes', float('nan')):.2f} "
            f"| {r.get('load_avg', ['-'])[0]} |"
        )
    if n:
        slowest(rows, n)


if __name__ == "__main__":
    main()
