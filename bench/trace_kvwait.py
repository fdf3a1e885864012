"""Interactive requests that waited for the engine's KV with no wait in the picker: what the
picker's books held for their server at the decision, against the engine's own KV on their
arrival (issue 15, twenty-first session).

    .venv/bin/python bench/trace_kvwait.py <bench_overload output> [--min-kv 0.1] [--all]

Reads a `--trace` run's `hi_trace` (per interactive request: the books, i.e. the
token-load-scorer's explained in-flight requests / tokens per server, the tokens flow
control counted for it, and the sim's `kv_arrival`: free, need, held blocks and the queue
ahead) and `all_trace` (every served request: arrival, band, server, estimate, max_tokens,
engine prompt tokens, picker wait, send to engine arrival, KV wait, done).

For each such request the engine's demand with it (held + queued ahead + its need, blocks)
is set against the books' view in engine blocks, and the difference split over the
requests behind it (rebuilt from `all_trace`):
- `in_engine_not_books`: on the server at the engine but not in the books at the decision
  (another replica's placements the exchange had not brought, or ends counted early);
- `in_books_not_engine`: in the books but not at the engine (sent, not arrived; ended, not
  yet in the access log): room the books under-state, on the safe side (negative);
- `unit`: on both, the engine's blocks (prompt + max_tokens, rounded up to blocks) less
  their count in the books (estimate + max_tokens over `kvCacheFraction`);
- `self_unit`: the same for the request itself.
Also `hol`: it would have fit alone (need <= free) but queued behind requests ahead (FCFS).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

BLOCK = 16
USABLE = 699  # the bench's 700 blocks less vLLM's null block
OUT_PER_REQ = 96  # the detector's outputTokens (the bench's OUTPUT_TOKENS)
ACCESS_LAG_S = 0.02  # request end to the picker's release (access-log flush, -ends20)


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def runs(path: str, trace: str = "hi_trace"):
    """Each run's JSON row of an overload bench output that carries `trace`, with the
    picker estimate / engine KV tokens fraction the bench printed before it."""
    frac = None
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        m = re.search(r"picker estimate / engine KV tokens ([0-9.]+)", line)
        if m:
            frac = float(m.group(1))
        if line.startswith("{") and f'"{trace}"' in line:
            yield json.loads(line), frac


def analyse(row: dict, frac: float, min_kv: float, show_all: bool) -> list[dict]:
    cap_tokens = frac * 700 * BLOCK  # the detector's ceiling (kvCacheFraction x KV size)
    reqs = []
    for at, band, ep, est, mx, prompt, wait, to_srv, kv, done in row.get("all_trace") or []:
        if to_srv < 0 or kv < 0:
            continue
        dec = at + wait
        arrive = at + to_srv
        reqs.append({"at": at, "band": band, "ep": ep, "est": est, "max": mx,
                     "kv_blocks": blocks(prompt + mx - 1), "dec": dec, "arrive": arrive,
                     "admit": arrive + kv, "done": done})  # fmt: skip
    out = []
    for t in row["hi_trace"]:
        eng = t.get("engine")
        ka = t.get("kv_arrival")
        if not eng or not ka or not t.get("books"):
            continue
        if not show_all and (eng[0] < min_kv or (t["wait"] or 0) >= 0.05):
            continue
        ep = t["endpoint"]
        b = t["books"].get(ep) or {}
        n, toks = b.get("inflight_requests", 0), b.get("inflight_tokens", 0)
        me = next((r for r in reqs if r["ep"] == ep and abs(r["at"] - t["at"]) < 0.002), None)
        if me is None:
            continue
        dec, arrive = me["dec"], me["arrive"]
        on = [r for r in reqs if r["ep"] == ep and r is not me]
        books_set = [r for r in on if r["dec"] < dec and r["done"] + ACCESS_LAG_S > dec]
        engine_set = [r for r in on if r["arrive"] < arrive and r["done"] > arrive]
        ids_b, ids_e = {id(r) for r in books_set}, {id(r) for r in engine_set}
        common = [r for r in engine_set if id(r) in ids_b]
        only_e = [r for r in engine_set if id(r) not in ids_b]
        only_b = [r for r in books_set if id(r) not in ids_e]

        def counted(r: dict) -> float:
            # In engine blocks, as the books count it.
            return (r["est"] + r["max"]) / frac / BLOCK

        unit = sum(r["kv_blocks"] - counted(r) for r in common)
        in_e = sum(r["kv_blocks"] for r in only_e)
        in_b = -sum(counted(r) for r in only_b)
        self_unit = ka["need_blocks"] - (t.get("flow_tokens") or 0) / frac / BLOCK
        demand = ka["held_blocks"] + ka["ahead_blocks"] + ka["need_blocks"]
        # The books' view with it on, in tokens: in-flight tokens + outputs (the detector's
        # constant; each request's own max_tokens is close: the controller corrects the
        # difference for its own placements) + this request's count.
        books_after = toks + n * OUT_PER_REQ + (t.get("flow_tokens") or 0)
        model_blocks = sum(r["kv_blocks"] for r in engine_set)
        out.append({
            "at": t["at"], "tenant": t["tenant"], "ep": ep[-5:], "kv_wait": eng[0],
            "picker_wait": round(t["wait"] or 0, 3),
            "books_sat_after": round(books_after / cap_tokens, 3),
            "books_n": n, "books_tokens": toks,
            "engine": ka, "engine_demand": demand, "over_blocks": demand - USABLE,
            "hol": ka["need_blocks"] <= ka["free_blocks"] and ka["ahead"] > 0,
            "rebuilt_engine_blocks": model_blocks,
            "engine_held_plus_ahead": ka["held_blocks"] + ka["ahead_blocks"],
            "rebuilt_books_n": len(books_set),
            "split": {"in_engine_not_books": in_e, "n_in_engine_not_books": len(only_e),
                      "in_books_not_engine": round(in_b, 1), "n_in_books_not_engine":
                      len(only_b), "unit": round(unit, 1), "self_unit": round(self_unit, 1),
                      "ahead_bands": sorted(r["band"] for r in engine_set
                                            if r["admit"] > arrive)},
        })  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--min-kv", type=float, default=0.1)
    ap.add_argument("--all", action="store_true", help="every interactive request")
    args = ap.parse_args()
    for path in args.paths:
        for row, frac in runs(path):
            if frac is None:
                print(f"{path}: no estimate ratio line", file=sys.stderr)
                continue
            found = analyse(row, frac, args.min_kv, args.all)
            print(f"== {path} {row['run']}: {len(found)} request(s)")
            for f in found:
                print(json.dumps(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
