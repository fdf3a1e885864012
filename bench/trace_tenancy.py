"""How a router kept tenants together in a traced tenants run, for any router: extproc's
traces and sglang-router's alike (`bench/trace_routing.py --modes approximate sglang`), from
where each request went and what the engine served, without the picker's decision.

    uv run python bench/trace_tenancy.py trace/tenants-approximate-0.jsonl:SEED [...]

SEED is the trace's seed (the requests' exact block keys are rebuilt from it). The run's own
placements are replayed through LRU caches of the servers' size (placement_oracle.py's model)
so a miss can be told apart by what the tenant's previous server still held. A request
missed when the engine served under half its prompt from cache. Known tenants' misses:
- stayed: sent to the server the tenant's previous request went to, which had evicted it;
- moved, home held it: sent elsewhere while the previous server still held more than the
  header every tenant shares (in the replay): a spill or a split the router chose;
- moved, home had evicted it: sent elsewhere, and the previous server no longer held it.
Per tenant: the servers it was written to and the share of its requests on its most used
server; per server: how many tenants it took.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_routing import PRESSURE_SHAPE, ideal_items
from placement_oracle import BLOCK, Lru, keyed


def tenancy(path: str, seed: int) -> dict:
    rows = sorted(
        (json.loads(line) for line in Path(path).read_text().splitlines()),
        key=lambda r: r["sent_s"],
    )
    rows = [r for r in rows if r.get("status") == 200 and "ttft_s" in r]
    items = {it.index: (it, b, n) for it, b, n in keyed(ideal_items("tenants", 0, 0, seed))}
    _, sim_args = PRESSURE_SHAPE["tenants"]
    size = int(sim_args[list(sim_args).index("--num-gpu-blocks") + 1])
    caches = {s: Lru(size) for s in {r["served_by"] for r in rows}}
    firsts: dict[int, list[int]] = {}
    for it, b, _ in items.values():
        firsts.setdefault(it.group, b)
    header = next(i for i, ks in enumerate(zip(*firsts.values(), strict=False)) if len(set(ks)) > 1)
    ttfts = sorted(r["ttft_s"] for r in rows)
    p90 = ttfts[int(0.9 * len(ttfts))]
    out: collections.Counter = collections.Counter()
    slow: collections.Counter = collections.Counter()
    last: dict[int, str] = {}
    per_tenant: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    per_server: dict[str, set[int]] = collections.defaultdict(set)
    prompt = cached = 0
    for r in rows:
        it, blocks, n = items[r["index"]]
        t, s, limit = r["tenant"], r["served_by"], (n - 1) // BLOCK
        missed = r.get("cached_tokens", 0) < 0.5 * r.get("prompt_tokens", 1)
        prompt += r.get("prompt_tokens", 0)
        cached += r.get("cached_tokens", 0)
        home = last.get(t)
        if home is None:
            cause = "hit" if not missed else "new tenant"
        elif not missed:
            cause = "hit" if s == home else "hit, moved to another holder"
        elif s == home:
            cause = "known, stayed: home had evicted it"
        elif caches[home].prefix(blocks, limit) > header:
            cause = "known, moved: home still held it"
        else:
            cause = "known, moved: home had evicted it"
        out[cause] += 1
        if r["ttft_s"] >= p90:
            slow[cause] += 1
        if home is not None:
            out["known tenant requests"] += 1
            out["known tenant requests moved"] += s != home
        caches[s].store(blocks[: n // BLOCK])
        last[t] = s
        per_tenant[t][s] += 1
        per_server[s].add(t)
    sizes = sorted(per_tenant, key=lambda t: -sum(per_tenant[t].values()))
    report: dict = {
        "hit ratio": f"{cached / max(prompt, 1):.1%}",
        "TTFT p90": f"{p90:.3f}",
        **{k: f"{v} ({slow[k]} at/above p90)" if k in slow else v for k, v in sorted(out.items())},
        "biggest tenants, requests:servers:home share": " ".join(
            f"{sum(per_tenant[t].values())}:{len(per_tenant[t])}:"
            f"{max(per_tenant[t].values()) / sum(per_tenant[t].values()):.0%}"
            for t in sizes[:8]
        ),
        "servers per tenant, mean (tenants with 3+ requests)": round(
            statistics.mean(len(per_tenant[t]) for t in sizes if sum(per_tenant[t].values()) >= 3),
            2,
        ),
        "tenants per server": "/".join(
            str(len(v)) for v in sorted(per_server.values(), key=len, reverse=True)
        ),
    }
    return report


def main(argv: list[str]) -> int:
    for arg in argv:
        path, _, seed = arg.rpartition(":")
        print(path)
        for k, v in tenancy(path, int(seed)).items():
            print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
