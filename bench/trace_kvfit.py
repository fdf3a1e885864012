"""What `predicted-ttft-scorer`'s KV-fit wait did in a traced run (bench/trace_routing.py with
a `-kvfit*` mode): which final picks it changed, whether a changed pick left the candidate
holding more of the prompt, and how its predicted wait at the served server compares with
the KV wait the simulator really had.

    uv run python bench/trace_kvfit.py trace/tenants-redis1-kvfit-0.jsonl [...]

Each decision is rebuilt from its explain terms: the wait's share of a candidate's cost is
what it added over the queue the other terms made (`kv_fit_wait_s` less the virtual queue,
the peers' pending tokens and the scraped waiting floor), less the holder's margin
(`kv_fit_margin_s`); the profile's total is taken again with that share removed from this
scorer's score (`--weight`, 4 in the default profile). A pick that moved to a candidate
holding over `--held` less of the prompt counts as "off a holder". Requests sent in the
first 0.3 s are skipped (every candidate is empty and ties are broken by rounding).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SCORER = "default/predicted-ttft-scorer"
REAL_WAIT_S = 0.02  # a KV wait shorter than this is the engine's step, not a wait for blocks


def _queue(t: dict) -> float:
    """The queue the prediction had before the KV-fit floor (seconds)."""
    q = t.get("virtual_queue_s", 0.0) + t.get("peers_pending_s", 0.0)
    return max(q, t.get("waiting_floor_s", 0.0), 0.0)


def summarize(path: Path, weight: float, held_gap: float) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in rows if r.get("decision") and "engine_s" in r]
    out = {"requests": len(rows), "changed": 0, "off_holder": 0, "to_holder": 0}
    seen = {"predicted": 0, "false_alarm": 0, "unpredicted": 0, "unpredicted_s": 0.0}
    off = []
    for r in rows:
        d = r["decision"]
        terms = d["terms"].get(SCORER, {})
        served = r["served_by"]
        if served not in terms:
            continue
        pred = terms[served].get("kv_fit_wait_s", 0.0)
        real = r["engine_parts"]["kv_wait_s"]
        if pred > 0:
            seen["predicted" if real > REAL_WAIT_S else "false_alarm"] += 1
        elif real > REAL_WAIT_S:
            seen["unpredicted"] += 1
            seen["unpredicted_s"] += real
        if r["sent_s"] < 0.3:
            continue
        total = d["scores"]["default/total"]
        cost = {a: t["predicted_s"] + t["eviction_s"] - t.get("kv_fit_margin_s", 0.0)
                for a, t in terms.items()}  # fmt: skip
        added = {
            a: max(0.0, t.get("kv_fit_wait_s", 0.0) - _queue(t)) - t.get("kv_fit_margin_s", 0.0)
            for a, t in terms.items()
        }
        without = {a: cost[a] - added[a] for a in terms}
        best, best0 = min(cost.values()), min(without.values())
        total0 = {a: total[a] - weight * (best / cost[a] - best0 / without[a]) for a in terms}
        alt = max(total0, key=lambda a: total0[a])
        if alt == served:
            continue
        out["changed"] += 1
        n = d["request_blocks"] or 1
        gap = (d["prefix_blocks"].get(alt, 0) - d["prefix_blocks"].get(served, 0)) / n
        if gap > held_gap:
            out["off_holder"] += 1
            off.append(
                f"#{r['index']} holder's wait {terms[alt].get('kv_fit_wait_s', 0):.3f} s; "
                f"served: real KV wait {real:.3f} s, TTFT {r['ttft_s']:.3f} s"
            )
        elif -gap > held_gap:
            out["to_holder"] += 1
    out |= seen
    out["off_holder_moves"] = off
    waits = [r["engine_parts"]["kv_wait_s"] for r in rows]
    out["kv_wait_s"] = round(sum(waits), 2)
    out["ttft_p90_s"] = statistics.quantiles([r["ttft_s"] for r in rows], n=10)[-1]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--weight", type=float, default=4.0, help="the scorer's weight in the profile")
    p.add_argument("--held", type=float, default=0.3, help="share of the prompt: 'a holder'")
    args = p.parse_args(argv)
    for path in args.traces:
        s = summarize(path, args.weight, args.held)
        print(
            f"{path.name}: picks changed {s['changed']} (off a holder {s['off_holder']}, to "
            f"one {s['to_holder']}); real KV waits > 20 ms predicted {s['predicted']}, "
            f"unpredicted {s['unpredicted']} ({s['unpredicted_s']:.2f} s), false alarms "
            f"{s['false_alarm']}; KV wait summed {s['kv_wait_s']} s; p90 {s['ttft_p90_s']:.3f}"
        )
        for line in s["off_holder_moves"]:
            print("   off a holder:", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
