"""Replicas racing for the same free KV: KV-block waits that came right after a different
replica placed on the same server, from `bench/trace_routing.py`'s rows (one JSON line per
request, with the picker's `x-extproc-decision`).

    uv run python bench/trace_race.py trace/tenants-redis3-kvfit-0.jsonl [...]

A KV wait is a request the simulator held more than `--wait` seconds (default 0.02) for
blocks (`engine_parts.kv_wait_s`). It "raced" when another request sent at most `--window`
seconds (default 0.1) before it went to the same server and was decided by a different
picker (the decision's `picker`, its process id): two replicas sent work to one server
within a scrape interval, neither seeing the other's in the engine's counts. One replica's
traces have no races by this definition; their waits after its own placements within the
window are printed alongside (`after own`), the part a replica's own placements since the
scrape already cover.

Per file: the KV waits (count, seconds), the raced ones (count, seconds), those in the first
5 s (the burst), and, when the decisions carry predicted TTFT's terms for the chosen server
(explained decisions), how many of the raced waits the deciding replica's prediction counted
any peers' tokens placed there since the scrape for (`kv_peer_tokens` > 0) and how many it
predicted a KV wait for (`kv_fit_wait_s` > 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_SCORER = "default/predicted-ttft-scorer"


def _terms(row: dict) -> dict | None:
    d = row.get("decision") or {}
    terms = (d.get("terms") or {}).get(_SCORER) or {}
    return terms.get(row.get("served_by", ""))


def races(rows: list[dict], wait_s: float, window_s: float) -> dict[str, float]:
    rows = sorted(
        (r for r in rows if r.get("decision") and "engine_parts" in r), key=lambda r: r["sent_s"]
    )
    out = dict.fromkeys(
        (
            "waits",
            "wait_s",
            "raced",
            "raced_s",
            "raced_burst",
            "after_own",
            "seen_peers",
            "predicted",
        ),
        0.0,
    )
    for i, r in enumerate(rows):
        kv = r["engine_parts"]["kv_wait_s"]
        if kv <= wait_s:
            continue
        out["waits"] += 1
        out["wait_s"] += kv
        picker, server, t = r["decision"].get("picker"), r["served_by"], r["sent_s"]
        before = [
            p for p in rows[:i]
            if p["served_by"] == server and t - window_s <= p["sent_s"] <= t
        ]  # fmt: skip
        if any(p["decision"].get("picker") != picker for p in before):
            out["raced"] += 1
            out["raced_s"] += kv
            out["raced_burst"] += t < 5.0
            terms = _terms(r)
            if terms is not None:
                out["seen_peers"] += terms.get("kv_peer_tokens", 0.0) > 0
                out["predicted"] += terms.get("kv_fit_wait_s", 0.0) > 0
        elif before:
            out["after_own"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--wait", type=float, default=0.02, help="a KV wait: seconds held for blocks")
    p.add_argument("--window", type=float, default=0.1, help="a race: seconds after a peer's send")
    args = p.parse_args(argv)
    for path in args.traces:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        c = races(rows, args.wait, args.window)
        print(
            f"{path.name}: KV waits {c['waits']:.0f} ({c['wait_s']:.2f} s), raced {c['raced']:.0f} "
            f"({c['raced_s']:.2f} s; {c['raced_burst']:.0f} in the first 5 s), after own "
            f"{c['after_own']:.0f}; of the raced, the decider counted peers' tokens since the "
            f"scrape in {c['seen_peers']:.0f}, predicted a KV wait in {c['predicted']:.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
