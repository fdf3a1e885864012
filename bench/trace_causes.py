"""Why each request of a tenants trace missed the cache, from `bench/trace_routing.py`'s rows
(one JSON line per request, with the picker's `x-extproc-decision`).

    uv run python bench/trace_causes.py trace/tenants-approximate-0.jsonl [...]

A request missed when the engine served under half its prompt from cache. Causes, in order:
- new tenant: the tenant's first request (no router could hit);
- spill, holder lost on score: the index credited another endpoint with more of the prompt
  (beyond the header every tenant shares) and it was a candidate, but scored lower;
- spill, holder filtered out: that endpoint was removed by a filter;
- index credited chosen: the index credited the chosen endpoint, the engine had evicted it;
- known tenant evicted everywhere: the index credited nobody with more than the header.
Printed per file with how many of each are at or above the run's TTFT p90.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path

CAUSES = (
    "new tenant",
    "known tenant, evicted everywhere (index credits nobody)",
    "spill: index holder lost on score",
    "spill: index holder filtered out",
    "index credited chosen, engine had evicted",
    "hit",
)


def classify(rows: list[dict]) -> tuple[collections.Counter, collections.Counter, float]:
    rows = sorted(rows, key=lambda r: r["sent_s"])
    ok = [r for r in rows if r.get("decision") and "ttft_s" in r]
    ttfts = sorted(r["ttft_s"] for r in ok)
    p90 = ttfts[int(0.9 * len(ttfts))] if ttfts else float("nan")
    # Blocks every tenant shares (the chat header): what the index credits every endpoint with
    # on most requests (the first few, before any placement, see less).
    minima = [min(r["decision"]["prefix_blocks"].values(), default=0) for r in ok]
    header = statistics.median_low(minima) if minima else 0
    seen: set[int] = set()
    causes: collections.Counter = collections.Counter()
    slow: collections.Counter = collections.Counter()
    for r in ok:
        d = r["decision"]
        held, scored = d["prefix_blocks"], d["scores"].get("default/total", {})
        best, mine = max(held.values(), default=0), held.get(r["served_by"], 0)
        if r.get("cached_tokens", 0) >= 0.5 * r.get("prompt_tokens", 0):
            cause = CAUSES[5]
        elif r["tenant"] not in seen:
            cause = CAUSES[0]
        elif best > header and mine < best:
            holders = [a for a, n in held.items() if n == best]
            cause = CAUSES[2] if any(h in scored for h in holders) else CAUSES[3]
        elif mine > header:
            cause = CAUSES[4]
        else:
            cause = CAUSES[1]
        causes[cause] += 1
        slow[cause] += r["ttft_s"] >= p90
        seen.add(r["tenant"])
    return causes, slow, p90


def main(argv: list[str]) -> int:
    for path in argv:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        causes, slow, p90 = classify(rows)
        prompt = sum(r.get("prompt_tokens", 0) for r in rows)
        cached = sum(r.get("cached_tokens", 0) for r in rows)
        print(f"{path}: hit {cached / max(prompt, 1):.1%}, TTFT p90 {p90:.3f} s")
        for cause in CAUSES:
            print(f"  {causes[cause]:4d} ({slow[cause]:3d} at or above p90)  {cause}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
