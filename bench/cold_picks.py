"""The replicas' new-prefix picks in a run's first seconds, from bench/trace_routing.py's
per-request rows (each carries the deciding replica's explained decision).

    python bench/cold_picks.py DIR/tenants-redis3-obs-0.jsonl [...] [--window 1 2 3]

A decision is a cold pick when `no-hit-lru-scorer` deemed its request new (no candidate
holds more of it than most candidates do: the scorer's own rule, applied to the decision's
candidates and prefix matches) and it then records where the request went. For each run:

- cold picks per server in the first 1, 2, 3 s (sending time), and how many went to a server
  that already had one while a candidate had none ("repeats");
- why each repeat happened: the deciding replica's LRU did not know the earlier pick
  (`unknown`: a peer's pick not yet arrived, or never shared), knew it and the other
  scorers outweighed it (`outweighed`), or the earlier pick was this replica's own
  (`own`, outweighed too);
- how many cold decisions the LRU never records (new on the filtered candidates it scored,
  not on every endpoint, which the router tells it of: a holder filtered out);
- how late a peer's pick arrives: for each cold decision and each earlier cold pick by
  another replica on one of its candidates (and none by the deciding replica there), whether
  the deciding replica's LRU knew it, by the time between the two; beside the gap between
  consecutive cold picks.

The replica is the decision's `picker` (its process id); times are the client's sending
times, so a pick's "age" includes no picker time on either side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import Counter
from pathlib import Path

LRU = "default/no-hit-lru-scorer"


def is_cold(cands: list[str], prefix: dict[str, float]) -> bool:
    """`NoHitLRUScorer._is_cold` on the decision's candidates."""
    blocks = [prefix.get(a, 0.0) for a in cands]
    best = max(blocks, default=0.0)
    if best <= 0:
        return True
    holders = sum(1 for b in blocks if b >= best)
    return len(cands) > 1 and holders * 2 > len(cands)


def picks(rows: list[dict], record_scored: bool = False) -> list[dict]:
    """Each decision: when, by which replica, where to, whether the scorer deemed it new on
    its candidates (`cold`: the LRU's scores decided) and on every endpoint (`recorded`: the
    router tells the scorer of a placement with every endpoint, pre-filter, so only such a
    pick moves the LRU and is published)."""
    everyone = sorted(
        {a for r in rows for a in ((r.get("decision") or {}).get("scores") or {}).get(LRU, {})}
    )
    out = []
    for r in rows:
        d = r.get("decision")
        if not d or not d.get("endpoints"):
            continue
        lru = d["scores"].get(LRU)
        if lru is None:
            continue
        prefix = d.get("prefix_blocks") or {}
        out.append(
            {
                "t": r["sent_s"],
                "replica": d.get("picker"),
                "to": d["endpoints"][0],
                "cold": is_cold(list(lru), prefix),
                "recorded": is_cold(everyone, prefix)
                or (record_scored and is_cold(list(lru), prefix)),
                "lru": lru,
            }
        )
    return sorted(out, key=lambda p: p["t"])


def analyse(rows: list[dict], windows: list[float], record_scored: bool = False) -> dict:
    """`record_scored`: the run's scorer had `recordCold: scored`."""
    ps = picks(rows, record_scored)
    servers = sorted({a for p in ps for a in p["lru"]})
    res: dict = {"replicas": len({p["replica"] for p in ps}), "windows": {}}
    for w in windows:
        cold = [p for p in ps if p["cold"] and p["t"] < w]
        per = Counter(p["to"] for p in cold)
        repeats: Counter[str] = Counter()
        unknown_age: list[float] = []
        first_by: dict[str, dict] = {}  # a server's first recorded pick
        for p in (p for p in ps if p["t"] < w):
            earlier = first_by.get(p["to"])
            untouched = [a for a in p["lru"] if a not in first_by]
            if p["cold"] and earlier is not None and untouched:
                # Score 1.0 on a cold request: the replica knows no pick of that server.
                if p["lru"][p["to"]] >= 1.0:
                    why = "unknown"
                    unknown_age.append(p["t"] - earlier["t"])
                elif earlier["replica"] == p["replica"]:
                    why = "own"
                else:
                    why = "outweighed"
                repeats[why] += 1
            if p["recorded"]:
                first_by.setdefault(p["to"], p)
        res["windows"][w] = {
            "cold": len(cold),
            # Deemed new on the candidates, not on every endpoint: the LRU never hears of it.
            "unrecorded": sum(1 for p in cold if not p["recorded"]),
            "all": sum(1 for p in ps if p["t"] < w),
            "per_server": [per.get(a, 0) for a in servers],
            "per_server_all": [sum(1 for p in ps if p["t"] < w and p["to"] == a) for a in servers],
            "repeats": dict(repeats),
            "unknown_repeat_ages": unknown_age,
        }
    # A peer's pick known or not at the deciding replica, by its age: servers with exactly
    # one earlier recorded pick, a peer's (so the score tells of that pick alone).
    known, unknown = [], []
    horizon = max(windows)
    early = [p for p in ps if p["t"] < horizon]
    for i, p in enumerate(early):
        if not p["cold"]:
            continue
        before: dict[str, list[dict]] = {}
        for q in early[:i]:
            if q["recorded"]:
                before.setdefault(q["to"], []).append(q)
        for a, qs in before.items():
            if len(qs) != 1 or qs[0]["replica"] == p["replica"] or a not in p["lru"]:
                continue
            (known if p["lru"][a] < 1.0 else unknown).append(p["t"] - qs[0]["t"])
    recorded = [p for p in early if p["recorded"]]
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(recorded)]
    res["known_ages"], res["unknown_ages"] = known, unknown
    res["gap_median"] = statistics.median(gaps) if gaps else None
    res["recorded"] = len(recorded)
    return res


def _buckets(known: list[float], unknown: list[float]) -> str:
    edges = (0.0, 0.025, 0.05, 0.1, 0.2, float("inf"))
    out = []
    for lo, hi in itertools.pairwise(edges):
        k = sum(1 for a in known if lo <= a < hi)
        u = sum(1 for a in unknown if lo <= a < hi)
        top = "+" if hi == float("inf") else f"-{hi * 1000:.0f}"
        out.append(f"{lo * 1000:.0f}{top} ms {k}/{k + u}")
    return ", ".join(out)


def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{len(xs)}: min {xs[0] * 1000:.0f} / median {statistics.median(xs) * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--window", nargs="+", type=float, default=[1.0, 2.0, 3.0])
    p.add_argument("--json", action="store_true", help="one JSON object per trace")
    args = p.parse_args(argv)
    for path in args.traces:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        res = analyse(rows, args.window, record_scored="-coldscored" in path.name)
        if args.json:
            print(json.dumps({"trace": str(path), **res}))
            continue
        print(f"{path} ({res['replicas']} replica(s))")
        for w, x in res["windows"].items():
            print(
                f"  < {w:g} s: {x['cold']} cold of {x['all']} ({x['unrecorded']} unrecorded), "
                f"per server "
                f"{'/'.join(map(str, x['per_server']))}, repeats {x['repeats'] or '{}'}"
                + f"; every request {'/'.join(map(str, x['per_server_all']))}"
                + (
                    f" (unknown ones' earlier pick {_ms(x['unknown_repeat_ages'])} before)"
                    if x["unknown_repeat_ages"]
                    else ""
                )
            )
        gap = res["gap_median"]
        print(
            f"  peers' single picks known by age: "
            f"{_buckets(res['known_ages'], res['unknown_ages'])}; {res['recorded']} recorded "
            f"picks < {max(args.window):g} s, gap median "
            + (f"{gap * 1000:.0f} ms" if gap is not None else "-")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
