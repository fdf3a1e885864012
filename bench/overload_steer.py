"""Where the pickers sent interactive work, from bench_overload.py's per-request trace
(`hi_trace`, runs with --trace): whether two replicas send interactive requests that arrive
close together to the same server (a shared view steers both to the same least-loaded
one), against one replica's own consecutive requests.

    .venv/bin/python bench/overload_steer.py [--window 0.5] out1.log out2.log ...

Per run: interactive requests per picker, and each picker's split over the servers; of the
pairs of consecutive interactive arrivals less than `--window` s apart, how many went to
the same server, when one picker placed both and when two different pickers did; and the
engine part (KV wait + step wait + prefill) of the second request of a pair, same server
against different, which is what a collision costs; and per request that arrived while
earlier interactive requests were short of their first token, whether it joined a server
where one of those was (placed by the same picker, `own`, or another, `peer`) while some
server had none (a collision the steering could have avoided).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from extproc.sim.workload import percentile


def _engine(t: dict) -> float | None:
    return sum(t["engine"]) if t.get("engine") else None


def steer_summary(trace: list[dict], window: float) -> dict:
    """The figures above for one run's trace (requests without a picker are skipped)."""
    reqs = sorted((t for t in trace if t.get("picker") is not None), key=lambda t: t["at"])
    split: dict[str, dict[str, int]] = {}
    for t in reqs:
        per = split.setdefault(str(t["picker"]), {})
        per[t["endpoint"]] = per.get(t["endpoint"], 0) + 1
    # (same picker?, same server?) -> pairs; and the second request's engine part.
    pairs: dict[str, int] = {}
    eng: dict[str, list[float]] = {"same": [], "other": []}
    for a, b in itertools.pairwise(reqs):
        if b["at"] - a["at"] >= window:
            continue
        who = "one picker" if a["picker"] == b["picker"] else "two pickers"
        where = "same" if a["endpoint"] == b["endpoint"] else "other"
        key = f"{who}, {where} server"
        pairs[key] = pairs.get(key, 0) + 1
        e = _engine(b)
        if who == "two pickers" and e is not None:
            eng[where].append(e)
    # Each request against the interactive ones before it still short of their first
    # token (arrived, TTFT not reached) when it arrived: did it join a server where one of
    # those was, placed by the same picker or by another, while a server had none?
    joined: dict[str, int] = {}
    joined_eng: dict[str, list[float]] = {}
    servers = {t["endpoint"] for t in reqs}
    for i, b in enumerate(reqs):
        busy: dict[str, set[str]] = {}
        for a in reqs[:i]:
            if a.get("ttft") is not None and a["at"] + a["ttft"] > b["at"]:
                who = "own" if a["picker"] == b["picker"] else "peer"
                busy.setdefault(a["endpoint"], set()).add(who)
        if not busy:
            continue
        there = busy.get(b["endpoint"], set())
        if not there:
            key = "went to a server with none"
        else:
            free = "a server had none" if servers - busy.keys() else "none free"
            key = f"joined {'+'.join(sorted(there))}'s, {free}"
        joined[key] = joined.get(key, 0) + 1
        e = _engine(b)
        if e is not None:
            joined_eng.setdefault(key, []).append(e)
    out: dict = {"interactive": len(reqs), "split": split, "pairs": pairs}
    out["beside_unfinished"] = {
        k: {"n": n, "engine_mean": round(sum(joined_eng.get(k, [0])) / max(1, n), 3)}
        for k, n in sorted(joined.items())
    }
    for where, es in eng.items():
        if es:
            out[f"two_pickers_{where}_server_engine"] = {
                "n": len(es),
                "mean": round(sum(es) / len(es), 3),
                "p90": round(percentile(es, 90), 3),
            }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=0.5)
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args()
    for path in args.paths:
        for line in Path(path).read_text().splitlines():
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if "hi_trace" in row:
                print(row["run"], json.dumps(steer_summary(row["hi_trace"], args.window)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
