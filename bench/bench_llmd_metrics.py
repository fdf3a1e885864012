"""Per-request cost of llm-d's request families (server/llmd_metrics.py: one stream's
routed -> response -> close) against the picker's own per-request metrics (the
`extproc_decision_seconds` observation and the routed counter), in the same run, alternating.

    uv run python bench/bench_llmd_metrics.py [--iterations 50000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from extproc.server.metrics import PickerMetrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    pm = PickerMetrics()
    llmd = pm.llmd
    headers = {"content-type": "application/json", ":path": "/v1/chat/completions"}

    def llmd_request() -> None:
        r = llmd.request()
        r.routed("llama", headers, 4096, 1000)
        r.response("200", "512")
        r.close()

    def own_request() -> None:
        pm.decision_seconds.observe(0.0003)
        pm.routed.inc()

    own, new = [], []
    for _ in range(args.rounds):
        own.append(timeit.timeit(own_request, number=args.iterations) / args.iterations * 1e6)
        new.append(timeit.timeit(llmd_request, number=args.iterations) / args.iterations * 1e6)
    print("| extproc_* per request µs (median of rounds) | llm-d families per request µs |")
    print("|---|---|")
    print(f"| {statistics.median(own):.2f} | {statistics.median(new):.2f} |")


if __name__ == "__main__":
    main()
