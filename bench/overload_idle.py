"""Where the engines' free KV went during an overload run's steady phase, from its timeline
(bench/overload_timeline.py; `--trace` runs of bench/bench_overload.py write one per run).

    python bench/overload_idle.py --ratio 1.247 <timeline.jsonl> ...

Per sample, each server's free KV (1 - its KV use) is split against the room the picker
kept for higher bands (`reserved` less `refill`, picker tokens, over `--ratio` picker
tokens per engine KV token and `--kv-tokens` per server), the server with the most free KV
taken as the one holding it:
- `reserve`: the holder's free KV up to the reserve;
- `holder_excess`: the holder's free KV above it (less than a queued request needs there,
  or the gate held it);
- `other_refill`: the other servers' free KV while the holder had less than the reserve
  (higher-band work had just taken part of it: lower work may go nowhere until a server
  has the whole reserve again, so what frees elsewhere meanwhile waits too);
- `other_slack`: the other servers' free KV while the holder had the reserve (the queued
  head did not fit, the gate held it, or nothing was queued).
Fractions of the fleet's KV, means over the samples in [`--start`, `--end`] s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def split(rows: list[dict], ratio: float, kv_tokens: int, servers: int) -> dict[str, float]:
    out = dict.fromkeys(
        ("used", "reserve", "holder_excess", "other_refill", "other_slack", "refilling"), 0.0
    )
    for r in rows:
        free = sorted((1.0 - r[f"kv{i}"] for i in range(servers)), reverse=True)
        # The room kept: the reserve less what a server may keep less of it (refill runs).
        kept = r.get("reserved", 0) - r.get("refill", 0)
        held = kept / (ratio * kv_tokens)  # of one server's KV
        out["used"] += sum(r[f"kv{i}"] for i in range(servers)) / servers
        out["reserve"] += min(free[0], held) / servers
        out["holder_excess"] += max(0.0, free[0] - held) / servers
        refilling = free[0] < held
        out["refilling"] += refilling * servers  # a time fraction, undone below
        key = "other_refill" if refilling else "other_slack"
        out[key] += sum(free[1:]) / servers
    n = max(1, len(rows))
    return {k: round(v / n / (servers if k == "refilling" else 1), 3) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("timelines", nargs="+")
    ap.add_argument(
        "--ratio",
        type=float,
        required=True,
        help="picker tokens per engine KV token (the run's estimate_ratio)",
    )
    ap.add_argument("--kv-tokens", type=int, default=700 * 16, help="engine KV per server")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--start", type=float, default=5.0)
    ap.add_argument("--end", type=float, default=60.0)
    args = ap.parse_args()
    for path in args.timelines:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        rows = [r for r in rows if "error" not in r and args.start <= r["t"] <= args.end]
        print(Path(path).name, json.dumps(split(rows, args.ratio, args.kv_tokens, args.servers)))


if __name__ == "__main__":
    main()
