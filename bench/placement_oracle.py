"""What hit ratio a router could reach on bench_routing's pressure workloads with the servers'
real cache sizes, computed offline (no servers, no timing): the unbounded-cache oracle that
bench_routing divides by, next to bounded ones that place every request perfectly for hits.

    uv run python bench/placement_oracle.py [--workloads tenants agentic] [--seeds 1 2]

`oracles` is what bench_routing.py divides each run's hit ratio by: the unbounded oracle and
the best bounded placement (the highest of the placements below with the real cache sizes;
the pooled optimum is a bound, not a placement, and round-robin is never the best).

Each server is an LRU cache of `blocks` blocks of the sim's exact block keys (the sim's
tokenizer), filled with each request's prompt blocks; a request's hit is its longest cached
block prefix (the engine recomputes the last prompt token). A request's blocks are refreshed
tail first, as vLLM returns a finished request's blocks to its free queue in reverse order, so
a shared prefix outlives the tails. Running requests holding blocks, output blocks and timing
are left out: the bounded figures are upper bounds for these placements, not predictions.

Placements:
- unbounded: one cache without a size limit (bench_routing's "ideal");
- greedy: each request to the server with the longest cached prefix for it, ties to the server
  with the fewest requests so far (hits first, load last: no router that also weighs load
  can beat it on hits by much, and it ignores load entirely);
- partition: whole tenants (groups, sessions) pinned to servers, largest first onto the
  server with the least prompt tokens so far (the best static split by size);
- memory: distinct, and a request matching nothing beyond the shared header whose
  distinguishing first block was placed before goes back to the server that last took it
  (placement-memory-scorer's rule);
- segregated: the biggest tenants (known in advance, by prompt tokens) pinned in pairs to all
  servers but one, the rest sharing the last one (they churn there instead of evicting the
  big ones: the best split found, with hindsight no router has);
- round-robin: for reference against the measured round-robin row;
- pooled optimum: a bound no placement can beat (see `pooled_optimum`).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from extproc.hashing.tokenizer import PreciseKeys, PreciseSettings
from extproc.requests import ParseSettings, parse_request
from extproc.sim.workload import WorkItem
from extproc.stack import SIM_TOKENIZER_DIR

BLOCK = 16


class Lru:
    """Block keys, least recently used first."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def prefix(self, blocks: Sequence[int], limit: int) -> int:
        n = 0
        for k in blocks[:limit]:
            if k not in self.keys:
                break
            n += 1
        return n

    def store(self, blocks: Sequence[int]) -> None:
        for k in reversed(blocks):  # the first block ends most recent
            self.keys[k] = None
            self.keys.move_to_end(k)
        if self.capacity is not None:
            while len(self.keys) > self.capacity:
                self.keys.popitem(last=False)


def keyed(items: Sequence[WorkItem]) -> list[tuple[WorkItem, list[int], int]]:
    """Each item with its sim block keys and prompt length in tokens."""
    precise = PreciseSettings(
        tokenizer_dir=str(SIM_TOKENIZER_DIR), model="tiny", block_size=BLOCK,
        image_token="<|pad|>",
    )  # fmt: skip
    keys = PreciseKeys.from_settings(precise)
    settings = ParseSettings(precise=precise)
    out = []
    for item in items:
        req = parse_request("/v1/chat/completions", {}, msgspec.json.encode(item.body), settings)
        ids, _ = keys.token_ids(req.prompt)
        out.append((item, list(keys.block_keys(req)), len(ids)))
    return out


Placement = Callable[[WorkItem, list[int], int, list[Lru], list[int]], int]


def greedy(item, blocks, limit, caches, counts) -> int:
    return max(range(len(caches)), key=lambda s: (caches[s].prefix(blocks, limit), -counts[s]))


def distinct(rows) -> Placement:
    """Greedy on the part of the prompt that tells tenants apart: a match no longer than the
    prefix every group shares (a template header) counts as no match, and a request with no
    match starts on the server with the fewest prompt tokens placed so far."""
    firsts: dict[int, list[int]] = {}
    for item, blocks, _ in rows:
        firsts.setdefault(item.group, blocks)
    common = 0
    if len(firsts) > 1:
        columns = zip(*firsts.values(), strict=False)
        common = next((i for i, ks in enumerate(columns) if len(set(ks)) > 1), 0)
    tokens: list[int] = []

    def place(item, blocks, limit, caches, counts) -> int:
        if not tokens:
            tokens.extend([0] * len(caches))
        hits = [c.prefix(blocks, limit) for c in caches]
        best = max(range(len(caches)), key=lambda s: (hits[s], -tokens[s]))
        if hits[best] <= common:
            best = tokens.index(min(tokens))
        tokens[best] += len(blocks)
        return best

    return place


def _common(rows) -> int:
    """Blocks every group's first request shares (a template header)."""
    firsts: dict[int, list[int]] = {}
    for item, blocks, _ in rows:
        firsts.setdefault(item.group, blocks)
    if len(firsts) < 2:
        return 0
    columns = zip(*firsts.values(), strict=False)
    return next((i for i, ks in enumerate(columns) if len(set(ks)) > 1), 0)


def memory(rows) -> Placement:
    """distinct, with a request that matches nothing beyond the header sent back to the
    server that last took its first distinguishing block."""
    common = _common(rows)
    tokens: list[int] = []
    last: dict[int, int] = {}

    def place(item, blocks, limit, caches, counts) -> int:
        if not tokens:
            tokens.extend([0] * len(caches))
        hits = [c.prefix(blocks, limit) for c in caches]
        best = max(range(len(caches)), key=lambda s: (hits[s], -tokens[s]))
        key = blocks[common] if len(blocks) > common else None
        if hits[best] <= common:
            best = last.get(key, tokens.index(min(tokens))) if key is not None else best
        tokens[best] += len(blocks)
        if key is not None:
            last[key] = best
        return best

    return place


def segregated(rows, per: int = 2) -> Placement:
    size: dict[int, int] = {}
    for item, _, n in rows:
        size[item.group] = size.get(item.group, 0) + n
    order = sorted(size, key=size.get, reverse=True)
    home: dict[int, int] = {}

    def place(item, blocks, limit, caches, counts) -> int:
        if not home:
            hot = len(caches) - 1
            for i, g in enumerate(order[: hot * per]):
                r, c = divmod(i, hot)
                home[g] = c if r % 2 == 0 else hot - 1 - c  # snake order: sizes balance
            for g in order[hot * per :]:
                home[g] = hot
        return home[item.group]

    return place


def round_robin(item, blocks, limit, caches, counts) -> int:
    return sum(counts) % len(caches)


def partition(rows) -> Placement:
    size: dict[int, int] = {}
    for item, _, n in rows:
        size[item.group] = size.get(item.group, 0) + n
    home: dict[int, int] = {}

    def place(item, blocks, limit, caches, counts) -> int:
        if not home:
            load = [0] * len(caches)
            for g in sorted(size, key=size.get, reverse=True):
                s = load.index(min(load))
                home[g] = s
                load[s] += size[g]
        return home[item.group]

    return place


def hit_ratio(rows, servers: int, capacity: int | None, place: Placement) -> float:
    caches = [Lru(capacity) for _ in range(servers)]
    counts = [0] * servers
    hit = total = 0
    for item, blocks, n in rows:
        limit = (n - 1) // BLOCK
        s = place(item, blocks, limit, caches, counts)
        counts[s] += 1
        hit += caches[s].prefix(blocks, limit) * BLOCK
        total += n
        caches[s].store(blocks[: n // BLOCK])
    return hit / total if total else 0.0


def pooled_optimum(rows, capacity: int) -> float:
    """An upper bound for every router and every eviction policy: one cache as large as the
    whole fleet's, evicting by Belady's rule (the block used again furthest in the future
    goes first), every block that is present counted as a hit, prefix or not. A fleet of
    separate caches holds at most that many blocks at once, each stored on demand like here,
    so no placement can hit more."""
    accesses: list[tuple[list[int], int]] = []
    uses: dict[int, list[int]] = {}
    t = 0
    for _, blocks, n in rows:
        limit = (n - 1) // BLOCK
        stored = blocks[: n // BLOCK]
        accesses.append((blocks[:limit], t))
        for k in blocks[:limit]:
            uses.setdefault(k, []).append(t)
        t += 1
        for k in stored:
            uses.setdefault(k, []).append(t)
        t += 1
    cursor = {k: 0 for k in uses}

    def next_use(k: int, now: int) -> int:
        times = uses[k]
        i = cursor[k]
        while i < len(times) and times[i] <= now:
            i += 1
        cursor[k] = i
        return times[i] if i < len(times) else 1 << 60

    cache: set[int] = set()
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped
    hit = total = 0
    for (_, blocks, n), (looked, t) in zip(rows, accesses, strict=True):
        hit += sum(1 for k in looked if k in cache) * BLOCK
        total += n
        for k in blocks[: n // BLOCK]:
            cache.add(k)
            heapq.heappush(heap, (-next_use(k, t + 1), k))
        while len(cache) > capacity:
            neg, k = heapq.heappop(heap)
            if k in cache and -neg == next_use(k, t + 1):
                cache.discard(k)
    return hit / total if total else 0.0


@dataclass(frozen=True, slots=True)
class Oracles:
    """A workload's reachable hit ratios: `unbounded` (one cache without a size limit, the
    ceiling no router passes) and `bounded`, the best of the offline placements with the
    servers' real cache sizes (`best` names it), what the issue-14 hit-ratio target is
    checkable against."""

    unbounded: float
    bounded: float
    best: str


def bounded_placements(rows, servers: int, blocks: int) -> dict[str, float]:
    """Each offline placement's hit ratio on `servers` LRU caches of `blocks` blocks."""
    return {
        "greedy": hit_ratio(rows, servers, blocks, greedy),
        "distinct": hit_ratio(rows, servers, blocks, distinct(rows)),
        "partition": hit_ratio(rows, servers, blocks, partition(rows)),
        "memory": hit_ratio(rows, servers, blocks, memory(rows)),
        "segregated": hit_ratio(rows, servers, blocks, segregated(rows)),
    }


def oracles(rows, servers: int, blocks: int) -> Oracles:
    """The unbounded oracle and the best bounded placement for `keyed` rows (an agentic
    workload's rows grouped by session, the unit a partition pins: see `by_session`)."""
    figs = bounded_placements(rows, servers, blocks)
    best = max(figs, key=figs.__getitem__)
    return Oracles(hit_ratio(rows, 1, None, greedy), figs[best], best)


def by_session(rows):
    """Agentic rows with each session as its own group (their items all have group 0)."""
    return [(replace(i, group=i.conversation), b, n) for i, b, n in rows]


def main(argv: list[str] | None = None) -> int:
    # bench_routing imports this module for its oracle columns: imported here, not above.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_routing import PRESSURE_SHAPE, ideal_items

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=["tenants", "agentic"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sessions", type=int, default=8)
    a = p.parse_args(argv)
    for wl in a.workloads:
        servers, sim_args = PRESSURE_SHAPE[wl]
        blocks = int(sim_args[list(sim_args).index("--num-gpu-blocks") + 1])
        for seed in a.seeds:
            load = a.sessions if wl == "agentic" else 0
            rows = keyed(ideal_items(wl, load, 0, seed))
            if wl == "agentic":  # a session is the unit a partition pins
                rows = by_session(rows)
            unbounded = hit_ratio(rows, 1, None, greedy)
            figs = {
                "pooled optimum": pooled_optimum(rows, servers * blocks),
                **bounded_placements(rows, servers, blocks),
                "round-robin": hit_ratio(rows, servers, blocks, round_robin),
            }
            cells = "  ".join(f"{k} {v:6.1%} ({v / unbounded:4.0%})" for k, v in figs.items())
            print(f"{wl:<8} seed {seed}: unbounded {unbounded:6.1%}  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
