"""Why each request of a tenants trace missed the cache, from `bench/trace_routing.py`'s rows
(one JSON line per request, with the picker's `x-extproc-decision`).

    uv run python bench/trace_causes.py trace/tenants-approximate-0.jsonl [...]

A request missed when the engine served under half its prompt from cache. Causes, in order:
- new tenant: the tenant's first request (no router could hit);
- spill, holder lost on score: the index credited another endpoint with more of the prompt
  (beyond the header every tenant shares) and it was a candidate, but scored lower;
- spill, holder filtered out: that endpoint was removed by a filter;
- index credited chosen: the index credited the chosen endpoint, the engine had evicted it;
- known tenant evicted everywhere: the index credited nobody with more than the header;
- known tenant, lookup degraded: the index did not answer in time (a Redis index), so it
  credited nobody either (counted before the spills and evictions).
Printed per file with how many of each are at or above the run's TTFT p90. For runs with
several picker replicas (the decision names its `picker`), `--replicas` also splits each
cause by whether the tenant's previous request was decided by the same or another replica,
and counts the misses a lag could explain: a known tenant the index credits nobody with
whose previous request was sent under `LAG_S` before (placed, but not yet seen, or only
just) and lookups answered degraded. `--moves` (agentic traces) lists each turn that left
its session's previous server: the prefix blocks the index credited the old and the new
server with, and each scorer's score for the new server minus the old one (the scorer
with the largest difference "decided"), or the filter that removed the old one.
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
    "known tenant, lookup degraded (the index answered nothing)",
)


def cause_of_each(rows: list[dict]) -> dict[int, str]:
    """Each decided request's cause (by its `index`), in send order."""
    rows = sorted(rows, key=lambda r: r["sent_s"])
    ok = [r for r in rows if r.get("decision") and "ttft_s" in r]
    # Blocks every tenant shares (the chat header): what the index credits every endpoint with
    # on most requests (the first few, before any placement, see less).
    minima = [min(r["decision"]["prefix_blocks"].values(), default=0) for r in ok]
    header = statistics.median_low(minima) if minima else 0
    seen: set[int] = set()
    out: dict[int, str] = {}
    for r in ok:
        d = r["decision"]
        held, scored = d["prefix_blocks"], d["scores"].get("default/total", {})
        best, mine = max(held.values(), default=0), held.get(r["served_by"], 0)
        if r.get("cached_tokens", 0) >= 0.5 * r.get("prompt_tokens", 0):
            cause = CAUSES[5]
        elif r["tenant"] not in seen:
            cause = CAUSES[0]
        elif d.get("index_degraded"):
            cause = CAUSES[6]
        elif best > header and mine < best:
            holders = [a for a, n in held.items() if n == best]
            cause = CAUSES[2] if any(h in scored for h in holders) else CAUSES[3]
        elif mine > header:
            cause = CAUSES[4]
        else:
            cause = CAUSES[1]
        out[r["index"]] = cause
        seen.add(r["tenant"])
    return out


def classify(rows: list[dict]) -> tuple[collections.Counter, collections.Counter, float]:
    ok = [r for r in rows if r.get("decision") and "ttft_s" in r]
    ttfts = sorted(r["ttft_s"] for r in ok)
    p90 = ttfts[int(0.9 * len(ttfts))] if ttfts else float("nan")
    cause = cause_of_each(rows)
    causes: collections.Counter = collections.Counter(cause.values())
    slow: collections.Counter = collections.Counter(
        cause[r["index"]] for r in ok if r["ttft_s"] >= p90
    )
    return causes, slow, p90


LAG_S = 0.5


def by_replica(rows: list[dict]) -> collections.Counter:
    """Each miss's cause, keyed with whether the tenant's previous request was decided by the
    same replica, and with the lag suspects and degraded lookups counted apart."""
    rows = sorted((r for r in rows if r.get("decision") and "ttft_s" in r),
                  key=lambda r: r["sent_s"])  # fmt: skip
    minima = [min(r["decision"]["prefix_blocks"].values(), default=0) for r in rows]
    header = statistics.median_low(minima) if minima else 0
    last: dict[int, dict] = {}
    out: collections.Counter = collections.Counter()
    for r in rows:
        d, prev = r["decision"], last.get(r["tenant"])
        last[r["tenant"]] = r
        missed = r.get("cached_tokens", 0) < 0.5 * r.get("prompt_tokens", 0)
        if prev is None:
            continue
        same = "same replica" if prev["decision"].get("picker") == d.get("picker") else "other"
        out[f"known tenant, previous decided by {same}"] += 1
        if d.get("index_degraded"):
            out[f"degraded lookup ({'miss' if missed else 'hit'})"] += 1
        if not missed:
            continue
        out[f"miss, previous decided by {same}"] += 1
        held = d["prefix_blocks"]
        if max(held.values(), default=0) <= header and r["sent_s"] - prev["sent_s"] < LAG_S:
            out[f"miss, index credits nobody, previous < {LAG_S} s before ({same})"] += 1
        recent = r["sent_s"] - prev["sent_s"] < LAG_S
        if recent and held.get(prev.get("served_by", ""), 0) <= header:
            out[f"miss, previous's server not credited, < {LAG_S} s ({same})"] += 1
    return out


def moves(rows: list[dict]) -> list[str]:
    """Each turn of a session served elsewhere than its previous turn, and why."""
    last: dict[int, str] = {}
    out: list[str] = []
    for r in sorted(rows, key=lambda r: (r["group"], r["turn"])):
        d, new = r.get("decision"), r.get("served_by")
        old = last.get(r["group"])
        if d and new and old and new != old:
            total = d["scores"].get("default/total", {})
            held = d["prefix_blocks"]
            where = f"session {r['group']} turn {r['turn']}: blocks {held.get(old, 0):g} -> "
            where += f"{held.get(new, 0):g} of {d['request_blocks']}"
            if d.get("index_degraded"):
                where += ", lookup degraded"
            if old not in total:
                why = "; ".join(x for x in d["reasons"] if old in x) or "; ".join(d["reasons"])
                out.append(f"{where}, old server filtered out: {why}")
            else:
                diffs = {
                    k.split("/")[-1]: round(v.get(new, 0.0) - v.get(old, 0.0), 3)
                    for k, v in d["scores"].items()
                    if k != "default/total"
                }
                top = max(diffs, key=lambda k: diffs[k])
                out.append(f"{where}, decided by {top}; new - old: {diffs}")
        if new:
            last[r["group"]] = new
    return out


def by_time(rows: list[dict], first_s: float = 5.0) -> list[str]:
    """Requests and their uncached prompt tokens per cause, all of the run and those sent in
    its first `first_s` seconds (where a replica's calibration transient falls)."""
    by = {r["index"]: r for r in rows}
    n: collections.Counter = collections.Counter()
    early: collections.Counter = collections.Counter()
    tokens: collections.Counter = collections.Counter()
    for index, cause in cause_of_each(rows).items():
        r, c = by[index], cause.split(" (")[0]
        n[c] += 1
        early[c] += r["sent_s"] < first_s
        tokens[c] += r.get("prompt_tokens", 0) - r.get("cached_tokens", 0)
    return [
        f"{n[c]:4d} (first {first_s:g} s {early[c]:3d}), uncached tokens {tokens[c]:7d}  {c}"
        for c in sorted(n, key=lambda c: -tokens[c])
    ]


def main(argv: list[str]) -> int:
    replicas = "--replicas" in argv
    if "--moves" in argv:
        for path in (a for a in argv if not a.startswith("--")):
            rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
            found = moves(rows)
            print(f"{path}: {len(found)} turns left their session's server")
            for line in found:
                print(f"  {line}")
        return 0
    early = "--early" in argv
    argv = [a for a in argv if a not in ("--replicas", "--early")]
    if early:
        for path in argv:
            rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
            print(f"{path}:")
            for line in by_time(rows):
                print(f"  {line}")
        return 0
    for path in argv:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        causes, slow, p90 = classify(rows)
        prompt = sum(r.get("prompt_tokens", 0) for r in rows)
        cached = sum(r.get("cached_tokens", 0) for r in rows)
        print(f"{path}: hit {cached / max(prompt, 1):.1%}, TTFT p90 {p90:.3f} s")
        for cause in CAUSES:
            print(f"  {causes[cause]:4d} ({slow[cause]:3d} at or above p90)  {cause}")
        if replicas:
            for key, n in sorted(by_replica(rows).items()):
                print(f"  {n:4d}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
