"""Where an overload run's steady goodput goes, per run of `--trace` outputs of
bench/bench_overload.py (issue 15, twenty-third session).

    .venv/bin/python bench/overload_goodput.py <bench_overload output> ...

Per run, over the steady window (`--start`, `--end`, the bench's 5-60 s):
- `kv`: the engines' KV held, rebuilt from `all_trace` (each served request holds
  ceil((prompt + max_tokens) / 16) blocks from its engine admission to its end; the sim
  reserves a request's whole KV at admission, so nothing is preempted or recomputed), as a
  fraction of the fleet's blocks; `hi_kv` the interactive band's part of it;
- the free KV split per timeline sample as bench/overload_idle.py splits it (`reserve`:
  the holder's free KV up to the room kept, `holder_excess`, `other_refill`, `other_slack`);
- `tok_per_block_s`: tokens produced (each request's prompt + output spread over its hold)
  per block-second held: what a full fleet would serve is that times the fleet's blocks
  (`bound_full`, over the invocation's capacity), an upper bound for any picker on these
  arrivals (the batch band stays queued throughout: `queued_lo_min`);
- `edge`: steady goodput (requests counted at their end, as capacity is) less the tokens
  produced inside the window: the burst's start and end;
- the spike term's inputs: interactive arrivals, how many of the last 100 had another within
  `--spike-s` before them, and the 0.9 quantile of those tokens (added to the largest) against
  the 0.95 quantile of each request's clump with its own tokens (`reserve_spike_joint`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overload_idle import split  # bench/overload_idle.py

BLOCK = 16
USABLE = 699  # the bench's 700 blocks per server less vLLM's null block


def quantile(values: list[int], q: float) -> int:
    v = sorted(values)
    return v[max(0, math.ceil(q * len(v)) - 1)] if v else 0


def runs(path: str):
    cap = frac = None
    for line in Path(path).read_text().splitlines():
        m = re.search(r"capacity: [0-9.]+ req/s, ([0-9.]+) tok/s;.*picker estimate / engine KV "
                      r"tokens ([0-9.]+)", line)  # fmt: skip
        if m:
            cap, frac = float(m.group(1)), float(m.group(2))
        if line.startswith('{"run"') and '"all_trace"' in line:
            yield json.loads(line), cap, frac


def analyse(row: dict, cap: float, frac: float, lo: float, hi: float, spike_s: float,
            servers: int) -> dict:  # fmt: skip
    held = hi_held = produced = 0.0
    for at, band, _ep, _est, mx, prompt, _wait, to_srv, kv, done in row["all_trace"]:
        if to_srv < 0 or kv < 0:
            continue
        admit = at + to_srv + kv
        blocks = math.ceil((prompt + mx) / BLOCK)
        inside = max(0.0, min(done, hi) - max(admit, lo))
        held += blocks * inside
        hi_held += blocks * inside if band > 0 else 0.0
        if done > admit:
            produced += (prompt + mx) * inside / (done - admit)
    fleet = servers * USABLE * (hi - lo)
    out = {"run": row["run"], "goodput": round(row["steady_goodput_vs_capacity"], 3),
           "kv": round(held / fleet, 3), "hi_kv": round(hi_held / fleet, 3)}  # fmt: skip
    tl = Path(row.get("timeline") or "")
    if tl.is_file():
        samples = [json.loads(x) for x in tl.read_text().splitlines()]
        samples = [s for s in samples if lo <= s["t"] <= hi]
        parts = split(samples, frac, 700 * BLOCK, servers)
        out.update({k: parts[k] for k in ("reserve", "holder_excess", "other_refill",
                                          "other_slack")})  # fmt: skip
        out["queued_lo_min"] = min(s["queued_lo"] for s in samples)
        out["reserved"] = round(sum(s["reserved"] for s in samples) / len(samples))
    eff = produced / held if held else 0.0
    out["tok_per_block_s"] = round(eff, 3)
    out["bound_full"] = round(eff * servers * USABLE / cap, 3)
    out["edge"] = round(row["steady_goodput_vs_capacity"] - produced / (hi - lo) / cap, 3)
    arrivals = sorted((t[0], t[3] + t[4]) for t in row["all_trace"] if t[1] > 0)
    ahead, clump = [], []
    for i, (at, tokens) in enumerate(arrivals):
        before = sum(tk for b, tk in arrivals[:i] if at - b < spike_s)
        ahead.append(before)
        clump.append(before + tokens)
    ahead, clump = ahead[-100:], clump[-100:]
    largest = max((tk for _, tk in arrivals[-100:]), default=0)
    out["hi_arrivals"] = len(arrivals)
    out["with_one_before"] = sum(1 for a in ahead if a > 0)
    out["spike_added"] = largest + quantile(ahead, 0.9)
    out["spike_joint95"] = max(largest, quantile(clump, 0.95))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outputs", nargs="+")
    ap.add_argument("--start", type=float, default=5.0)
    ap.add_argument("--end", type=float, default=60.0)
    ap.add_argument("--spike-s", type=float, default=0.3)
    ap.add_argument("--servers", type=int, default=2)
    args = ap.parse_args()
    for path in args.outputs:
        for row, cap, frac in runs(path):
            if cap is None or frac is None:
                continue
            res = analyse(row, cap, frac, args.start, args.end, args.spike_s, args.servers)
            print(json.dumps({"file": path, **res}))


if __name__ == "__main__":
    main()
