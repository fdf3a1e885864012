"""On two replicas, whose lower-band work took the room a slow interactive request then
waited for: per interactive request above `--over` x the invocation's unloaded p99, the
batch requests each picker admitted on each server in the `--before` seconds before it
arrived and while it waited in its picker, the interactive ones placed just before it (its
clump), each picker's reserve and refill credit at the last timeline sample, and each
server's KV use; then, over the run, how much of that batch work the request's own picker
admitted against the other one, next to the same count for every interactive request (the
base rate: each picker admits about half the batch work).

    .venv/bin/python bench/overload_rival.py <bench_overload.py --trace output> \
        [--over 2.0] [--before 0.5]

Needs a run of bench_overload.py with `all_picker`, `picker_pids` and the timeline's
`reserved_each` (the twenty-fifth session on); a run without them is skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _timeline(path: str) -> list[dict]:
    p = Path(path)
    if not path or not p.is_file():  # not kept (the run's temporary directory is gone)
        return []
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [r for r in rows if "error" not in r]


def _sample_at(tl: list[dict], t: float) -> dict:
    """The last timeline sample at or before `t` (the first one before any)."""
    best = tl[0] if tl else {}
    for r in tl:
        if r["t"] > t:
            break
        best = r
    return best


def rival(row: dict, unloaded_p99: float, over: float, before: float) -> dict | None:
    pids = row.get("picker_pids")
    who = row.get("all_picker")
    if not pids or who is None or len(pids) < 2:
        return None
    name = {pid: "AB"[i] if i < 2 else str(i) for i, pid in enumerate(pids)}
    reqs = []
    for t, pid in zip(row["all_trace"], who, strict=True):
        at, band, ep, est, mx, _prompt, wait, _to, kv, done = t
        reqs.append(
            {"at": at, "band": band, "ep": ep, "tok": est + mx, "out": at + wait,
             "kv": kv, "done": done, "picker": name.get(pid, "?")}
        )  # fmt: skip
    servers = sorted({r["ep"] for r in reqs})
    tl = _timeline(row.get("timeline", ""))
    hi = [t for t in row.get("hi_trace", []) if t.get("ttft") is not None]
    limit = over * unloaded_p99
    out: dict = {"run": row["run"].removeprefix("flow control "), "slow": [], "servers": servers}
    # own / other: batch tokens admitted in each request's window by its own picker or not.
    tally = {"slow": [0, 0], "all": [0, 0]}
    for h in sorted(hi, key=lambda t: t["at"]):
        me = name.get(h.get("picker"), "?")
        start, end = h["at"] - before, h["at"] + (h.get("wait") or 0.0)
        batch = [r for r in reqs if r["band"] == 0 and start <= r["out"] <= end]
        own = sum(r["tok"] for r in batch if r["picker"] == me)
        other = sum(r["tok"] for r in batch if r["picker"] != me)
        slow = h["ttft"] > limit
        for key in ("slow", "all") if slow else ("all",):
            tally[key][0] += own
            tally[key][1] += other
        if not slow:
            continue
        per: dict[str, dict[str, int]] = {}
        for r in batch:
            cell = per.setdefault(r["picker"], {})
            cell[r["ep"]] = cell.get(r["ep"], 0) + r["tok"]
        clump = [
            (round(r["out"] - h["at"], 2), r["picker"], servers.index(r["ep"]), r["tok"])
            for r in reqs
            if r["band"] == 1 and h["at"] - before <= r["out"] < h["at"] + 1e-3
        ]
        s = _sample_at(tl, h["at"])
        out["slow"].append(
            {
                "at": h["at"], "tenant": h["tenant"], "picker": me,
                "server": servers.index(h["endpoint"]) if h["endpoint"] in servers else -1,
                "ttft": h["ttft"], "wait": round(h.get("wait") or 0.0, 2),
                "engine_kv": (h.get("engine") or [0.0])[0],
                "batch": {p: {servers.index(e): v for e, v in c.items()} for p, c in per.items()},
                "clump": clump, "reserved": s.get("reserved_each"),
                "refill": s.get("refill_each"),
                # Free interactive capacity left to the other replica around it (the
                # samples covering its wait; fleet-wide fairness deferring).
                "defer_hi": sum(
                    r.get("defer_hi", 0) for r in tl if h["at"] <= r["t"] <= end + 0.5
                ),
                "kv": [s.get(f"kv{i}") for i in range(len(servers))],
            }
        )  # fmt: skip
    # How late a replica hears of the other's ends: per interactive request that waited over
    # 0.1 s in its picker, the last request to end on its server before it was released,
    # and how long after that end the release came (its own: the access log, ~20 ms; the
    # other replica's: the shared in-flight exchange, every 50 ms each way).
    lags: dict[str, list[float]] = {"own": [], "other": []}
    for r in reqs:
        if r["band"] != 1 or r["out"] - r["at"] < 0.1:
            continue
        ends = [e for e in reqs if e["ep"] == r["ep"] and r["at"] < e["done"] < r["out"]]
        if ends:
            last = max(ends, key=lambda e: e["done"])
            key = "own" if last["picker"] == r["picker"] else "other"
            lags[key].append(round(r["out"] - last["done"], 3))
    out["end_lags"] = lags
    # Per interactive request that waited over 0.1 s: the band's later requests released
    # while it waited (smaller ones that fit first), by its own picker and by the other,
    # and how many of their tokens went to the server it then went to.
    ahead = {"own": [0, 0], "other": [0, 0]}
    for r in reqs:
        if r["band"] != 1 or r["out"] - r["at"] < 0.1:
            continue
        for o in reqs:
            if o["band"] == 1 and r["at"] < o["at"] and r["at"] < o["out"] < r["out"]:
                key = "own" if o["picker"] == r["picker"] else "other"
                ahead[key][0] += 1
                ahead[key][1] += o["tok"] if o["ep"] == r["ep"] else 0
    out["jumped"] = ahead
    out["defer"] = [sum(r.get(f"defer_{b}", 0) for r in tl) for b in ("hi", "lo")]
    out["own_other_slow"] = tally["slow"]
    out["own_other_all"] = tally["all"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="+")
    ap.add_argument("--over", type=float, default=2.0)
    ap.add_argument("--before", type=float, default=0.5)
    args = ap.parse_args()
    for path in args.out:
        lines = Path(path).read_text().splitlines()
        # The invocation's summary (its unloaded p99) is printed after its runs.
        base = next((json.loads(x) for x in lines if x.startswith('{"capacity')), None)
        if base is None:
            print(f"{path}: no summary line yet (the invocation has not ended)")
            continue
        for line in lines:
            if not line.startswith('{"run"'):
                continue
            found = rival(json.loads(line), base["unloaded_ttft_p99"], args.over, args.before)
            if found is None:
                continue
            print(f"{path}: {found['run']} (servers {found['servers']})")
            for s in found["slow"]:
                print(
                    f"  {s['at']:6.2f} s {s['tenant']} via {s['picker']} on s{s['server']}: "
                    f"{s['ttft']:.2f} s (picker {s['wait']:.2f}, KV {s['engine_kv']:.2f}); "
                    f"reserve {s['reserved']} credit {s['refill']} kv {s['kv']}; "
                    f"interactive deferrals to the peer {s['defer_hi']}"
                )
                print(f"      batch admitted [-{args.before}, wait]: {s['batch']}")
                print(f"      interactive placed before it: {s['clump']}")
            own, other = found["own_other_slow"]
            all_own, all_other = found["own_other_all"]
            print(
                f"  batch tokens in the windows, own picker / other: slow {own} / {other}; "
                f"every interactive request {all_own} / {all_other}"
            )
            print(f"  deferrals to the peer over the run (interactive, batch): {found['defer']}")
            (own_n, own_t), (oth_n, oth_t) = found["jumped"]["own"], found["jumped"]["other"]
            print(
                f"  later interactive requests released while one waited > 0.1 s: own picker "
                f"{own_n} ({own_t} tokens on its server), other {oth_n} ({oth_t})"
            )
            for key, lag in found["end_lags"].items():
                lag = sorted(lag)
                mid = lag[len(lag) // 2] if lag else float("nan")
                print(
                    f"  picker waits > 0.1 s released after an end of the {key} replica's: "
                    f"{len(lag)}, end to release median {mid:.3f} s, all {lag}"
                )


if __name__ == "__main__":
    main()
