"""What happened to each tenant's prompt in a traced tenants run: the run's own placements
replayed through LRU caches of the servers' size (placement_oracle.py's model), to see where
each tenant was written, who evicted whom, and whether a "known tenant, evicted everywhere"
miss (bench/trace_causes.py) had anything left anywhere to go back to.

    uv run python bench/trace_evictions.py trace/tenants-approximate-0.jsonl:SEED [...]

SEED is the seed the trace ran with (`bench/trace_routing.py --seed`): the requests' exact
block keys are rebuilt from it. The replay is checked against the engines: its hit tokens
next to the `cached_tokens` they served (timing, running requests' blocks and the engine's
null block are left out of the model, so the two differ by a little).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_routing import PRESSURE_SHAPE, ideal_items
from placement_oracle import BLOCK, Lru, keyed


def replay(path: str, seed: int) -> dict:
    rows = sorted(
        (json.loads(line) for line in Path(path).read_text().splitlines()),
        key=lambda r: r["sent_s"],
    )
    items = {it.index: (it, b, n) for it, b, n in keyed(ideal_items("tenants", 0, 0, seed))}
    _, sim_args = PRESSURE_SHAPE["tenants"]
    blocks_per_server = int(sim_args[list(sim_args).index("--num-gpu-blocks") + 1])
    caches = {s: Lru(blocks_per_server) for s in {r["served_by"] for r in rows}}
    # The header every tenant shares, in the sim's blocks: the common prefix of tenants.
    firsts: dict[int, list[int]] = {}
    for it, b, _ in items.values():
        firsts.setdefault(it.group, b)
    header = next(i for i, ks in enumerate(zip(*firsts.values(), strict=False)) if len(set(ks)) > 1)
    owner: dict[int, int] = {}
    last: dict[int, str] = {}
    written: dict[int, set[str]] = collections.defaultdict(set)
    out: collections.Counter = collections.Counter()
    seen: set[int] = set()
    for r in rows:
        if r.get("status") != 200:
            continue
        it, blocks, n = items[r["index"]]
        t, s, limit = r["tenant"], r["served_by"], (n - 1) // BLOCK
        held = (r.get("decision") or {}).get("prefix_blocks") or {}
        credited_header = min(held.values(), default=0)
        missed = r.get("cached_tokens", 0) < 0.5 * r.get("prompt_tokens", 1)
        if missed and t in seen and max(held.values(), default=0) <= credited_header:
            out["evicted everywhere (as trace_causes counts them)"] += 1
            anywhere = max(c.prefix(blocks, limit) for c in caches.values())
            at_last = caches[last[t]].prefix(blocks, limit)
            out["  of which some server still held more than the header"] += anywhere > header
            out["  of which the tenant's last server held more than the header"] += at_last > header
            out["  of which sent to the tenant's last server"] += s == last[t]
        out["replayed hit tokens"] += caches[s].prefix(blocks, limit) * BLOCK
        out["served cached tokens"] += r.get("cached_tokens", 0)
        before = set(caches[s].keys)
        caches[s].store(blocks[: n // BLOCK])
        for k in blocks[: n // BLOCK]:
            owner.setdefault(k, t)
        for k in before - set(caches[s].keys):
            out["evicted blocks: the placed tenant's own" if owner[k] == t else
                "evicted blocks: another tenant's"] += 1  # fmt: skip
        seen.add(t)
        last[t] = s
        written[t].add(s)
    sizes = collections.Counter(r["tenant"] for r in rows)
    top = sorted(sizes, key=lambda t: -sizes[t])[:6]
    out["servers written, biggest tenants (requests:servers)"] = " ".join(
        f"{sizes[t]}:{len(written[t])}" for t in top
    )
    return out


def main(argv: list[str]) -> int:
    for arg in argv:
        path, _, seed = arg.rpartition(":")
        print(path)
        for k, v in replay(path, int(seed)).items():
            print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
