"""Spills of a `bench/trace_routing.py` tenants trace read through predicted TTFT's explained
terms (`terms` in each decision): what each side of a spill was predicted to have queued
against what it really had, and how the logged decisions re-score under other options.

    uv run python bench/spill_terms.py --phases 4.6 trace/tenants-redis3-0.jsonl [...]
    uv run python bench/spill_terms.py --sides trace/tenants-redis3-0.jsonl [...]
    uv run python bench/spill_terms.py --rescore trace/tenants-redis3-0.jsonl [...]
    uv run python bench/spill_terms.py --charged trace/tenants-redis3-spill-0.jsonl [...]
    uv run python bench/spill_terms.py --replayed rows/ trace/tenants-redis3-0.jsonl [...]

`--phases S`: hit ratio, spills and false credit before and after S seconds (the
replicas' uncalibrated start). `--sides`: per spill ("holder lost on score",
`trace_causes.py`), the queue predicted on the holder and on the destination, rescaled to
engine tokens by the request's own uncached prefill (an uncalibrated picker predicts at its
token estimate's scale), against the real backlog (`trace_causes.real_backlog`), and the
destination's in-flight floor as used against its in-flight tokens counted whole (and of
those, the deciding replica's own and the peers', when the terms give the peers').
`--replayed DIR`: per spill, the queue predicted on each side against the backlog the same
decisions left on a quiet replay (`replay_decisions.py --rows DIR`), uncalibrated decisions
apart. `--exchange S`: how much of the peers' arrived tokens the net change of their in-flight
totals, exchanged every S s, shows as arrivals (the rest is dated as the tokens it replaced).
`--charged`: with `spillCost: fleetBusy`, the decisions whose final pick the charge moved
(every scorer's total re-summed with the predicted-ttft score recomputed without
`spill_cost_s`): per picker process, how many, how often the charge kept the prefix holder,
the busy share the deciding replica saw against the share of candidates really backlogged,
the holder's predicted queue (rescaled to engine seconds) against its real backlog, and the
moved requests' TTFT against the run's.
`--rescore`: every decision with a strong holder (10+ blocks beyond the shared header)
re-scored from its logged terms and scores with the default profile's weights (no
feedback on later requests): how many keep the holder as run, with
`kv-cache-utilization-scorer` `countRequest`, `waitingFloor: endpointMean`, without the
in-flight floor, and without the scraped-waiting floor. The tenants bench's KV capacity
(400 blocks of 16 tokens) is assumed for `countRequest`.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

from trace_causes import CAUSES, cause_of_each, real_backlog

TTFT = "default/predicted-ttft-scorer"
WEIGHTS = {"predicted-ttft-scorer": 4.0, "kv-cache-utilization-scorer": 1.0,
           "no-hit-lru-scorer": 1.0, "session-tail-scorer": 2.0}  # fmt: skip
CAPACITY_TOKENS = 400 * 16
ENGINE_TPS = 10_000.0  # the tenants bench's simulator: 5,000 tok/s, time compressed 2x


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("decision") and "ttft_s" in r]


def _holder(d: dict) -> str | None:
    held, total = d["prefix_blocks"], d["scores"].get("default/total", {})
    best = max(held.values(), default=0)
    hs = [a for a, n in held.items() if n == best and a in total]
    return max(hs, key=lambda a: total[a]) if hs else None


def phases(rows: list[dict], cut: float) -> list[str]:
    cause = cause_of_each(rows)
    out = []
    ok = _ok(rows)
    for name, sel in (("before", [r for r in ok if r["sent_s"] < cut]),
                      ("after", [r for r in ok if r["sent_s"] >= cut])):  # fmt: skip
        c = collections.Counter(cause[r["index"]] for r in sel)
        prompt = sum(r.get("prompt_tokens", 0) for r in sel)
        hit = sum(r.get("cached_tokens", 0) for r in sel) / max(prompt, 1)
        out.append(
            f"{name} {cut:g} s: {len(sel)} requests, hit {hit:.1%}, holder lost on score "
            f"{c[CAUSES[2]]}, credited chosen evicted {c[CAUSES[4]]}, new tenants {c[CAUSES[0]]}"
        )
    return out


def _spills(rows: list[dict]) -> Iterator[tuple[dict, dict, str, float]]:
    """Each "holder lost on score" spill with predicted-ttft terms for both sides: the row,
    the terms per address, the holder, and the scale from the terms' uncached seconds to
    the destination's real prefill at the engine's speed."""
    cause = cause_of_each(rows)
    for r in _ok(rows):
        d = r["decision"]
        if cause[r["index"]] != CAUSES[2] or TTFT not in d.get("terms", {}):
            continue
        terms, held, new = d["terms"][TTFT], d["prefix_blocks"], r["served_by"]
        holder = _holder(d)
        if holder is None or holder not in terms or new not in terms:
            continue
        t = terms[new]
        real_prefill = r["prompt_tokens"] * (1 - held.get(new, 0) / d["request_blocks"])
        scale = real_prefill / ENGINE_TPS / t["uncached_s"] if t["uncached_s"] > 0 else 1.0
        yield r, terms, holder, scale


def sides(rows: list[dict]) -> str:
    h_pred, h_real, d_pred, d_real, used, whole = [], [], [], [], [], []
    own, peers = [], []  # the destination's in-flight tokens whole: this replica's, the peers'
    for r, terms, holder, scale in _spills(rows):
        new = r["served_by"]
        t = terms[new]
        h_pred.append(terms[holder]["queue_s"] * scale)
        h_real.append(real_backlog(rows, holder, r["sent_s"]))
        d_pred.append(t["queue_s"] * scale)
        d_real.append(real_backlog(rows, new, r["sent_s"]))
        used.append(t.get("inflight_floor_s", 0.0) * scale)
        whole.append(t["inflight_tokens"] / t["tps"] * scale)
        if "peer_inflight_tokens" in t:
            peers.append(t["peer_inflight_tokens"] / t["tps"] * scale)
            own.append(whole[-1] - peers[-1])
    if not h_pred:
        return "no spills with terms"
    m = statistics.mean
    return (
        f"{len(h_pred)} spills, means: holder's queue predicted {m(h_pred):.3f} s, real "
        f"{m(h_real):.3f} | destination's predicted {m(d_pred):.3f}, real {m(d_real):.3f}; "
        f"its in-flight floor used {m(used):.3f}, its in-flight tokens whole {m(whole):.3f}"
        + (f" (this replica's {m(own):.3f}, the peers' {m(peers):.3f})" if own else "")
    )


def replayed(rows: list[dict], rrows: list[dict]) -> list[str]:
    """Per spill, the queue predicted on each side against the backlog the same decisions
    left on a quiet replay (`replay_decisions.py --rows`: the simulators' lanes on time),
    uncalibrated decisions apart; and how often the holder would have been faster there."""
    again = {r["index"]: r for r in rrows}
    # The replay's server for each of the trace's (the same request went to both).
    name = {r["served_by"]: again[r["index"]]["served_by"] for r in rows
            if r.get("served_by") and again.get(r["index"], {}).get("served_by")}  # fmt: skip
    out: dict[str, list[tuple[float, ...]]] = {}
    for r, terms, holder, scale in _spills(rows):
        if r["index"] not in again:
            continue
        d, new = r["decision"], r["served_by"]
        held, t = d["prefix_blocks"], terms[new]
        h_back = real_backlog(rrows, name[holder], r["sent_s"])
        h_own = r["prompt_tokens"] * (1 - held.get(holder, 0) / d["request_blocks"]) / ENGINE_TPS
        uncal = d.get("prompt_tokens", 0) < 0.6 * r["prompt_tokens"]
        out.setdefault("uncalibrated" if uncal else "calibrated", []).append((
            t["queue_s"] * scale, real_backlog(rrows, name[new], r["sent_s"]),
            terms[holder]["queue_s"] * scale, h_back,
            float(h_back + h_own + 0.03 < again[r["index"]].get("ttft_s", float("inf"))),
        ))  # fmt: skip
    m = statistics.mean
    return [
        f"{k}: {len(v)} spills, means: destination's queue predicted {m(x[0] for x in v):.3f} s, "
        f"replayed {m(x[1] for x in v):.3f} | holder's predicted {m(x[2] for x in v):.3f}, "
        f"replayed {m(x[3] for x in v):.3f} | holder faster on the replay "
        f"{sum(x[4] for x in v):.0f}"
        for k, v in sorted(out.items())
    ] or ["no spills with terms"]


def exchange_shows(rows: list[dict], interval_s: float) -> str:
    """How much of the peers' prompt tokens the exchange's net change shows as arrivals
    (endpoints/peer_arrivals.py): for each deciding replica and server, the other replicas'
    requests counted from their send to their end (sent_s + total_s, in engine tokens),
    sampled every `interval_s`; a growth of the total is an arrival, and what arrived while
    as much ended in the same interval is hidden (dated as the old tokens it replaced)."""
    ok = [r for r in _ok(rows) if r.get("prompt_tokens") and "total_s" in r]
    pickers = sorted({r["decision"].get("picker", 0) for r in ok})
    end = max((r["sent_s"] + r["total_s"] for r in ok), default=0.0)
    arrived = shown = 0.0
    for p in pickers:
        for a in sorted({r["served_by"] for r in ok}):
            peers = [r for r in ok if r["served_by"] == a and r["decision"].get("picker", 0) != p]
            prev, k = 0, 0
            while (t := k * interval_s) < end + interval_s:
                total = sum(r["prompt_tokens"] for r in peers
                            if r["sent_s"] <= t < r["sent_s"] + r["total_s"])  # fmt: skip
                new = sum(r["prompt_tokens"] for r in peers if t - interval_s < r["sent_s"] <= t)
                arrived += new
                shown += min(new, max(0, total - prev))
                prev, k = total, k + 1
    if not arrived:
        return "no peers"
    return (
        f"exchange every {interval_s:g} s: the net change shows {shown / arrived:.1%} of the "
        f"peers' {arrived:.0f} arrived tokens (summed over deciding replicas)"
    )


def _rescore(d: dict, option: str) -> str:
    terms, scores = d["terms"][TTFT], d["scores"]
    pred, kv = {}, {}
    for a, t in terms.items():
        floor = 0.0 if option == "no in-flight floor" else t.get("inflight_floor_s", 0.0)
        q = max(t.get("virtual_queue_s", 0.0), floor)
        if "waiting_floor_s" in t and option != "no waiting floor":
            wf = t["waiting_floor_s"]
            if option == "waitingFloor: endpointMean" and t["inflight_requests"] > 0:
                w, n = t["waiting"], t["inflight_requests"]
                known = min(w, n)
                mean = t["mean_prefill"] or wf * t["tps"] / w
                wf = (known * t["inflight_tokens"] / n + (w - known) * mean) / t["tps"]
            q = max(q, wf)
        pred[a] = q + t["uncached_s"] + 0.005 + t["eviction_s"]
        free = 1.0 - t["kv_usage"]
        if option == "countRequest":
            free -= t["uncached_s"] * t["tps"] / CAPACITY_TOKENS
        kv[a] = 0.0 if t["stale"] or free < 0 else min(1.0, free)
    best = min(pred.values())
    total = {}
    for a in terms:
        s = (
            WEIGHTS["predicted-ttft-scorer"] * best / pred[a]
            + WEIGHTS["kv-cache-utilization-scorer"] * kv[a]
        )
        for k, v in scores.items():
            name = k.split("/")[-1]
            if name in ("no-hit-lru-scorer", "session-tail-scorer"):
                s += WEIGHTS[name] * v.get(a, 0.0)
        total[a] = s
    return max(total, key=lambda a: total[a])


OPTIONS = ("as run", "countRequest", "waitingFloor: endpointMean", "no in-flight floor",
           "no waiting floor")  # fmt: skip


def rescore(rows: list[dict]) -> str:
    ok = [r for r in _ok(rows) if TTFT in r["decision"].get("terms", {})]
    if not ok:
        return "no decisions with terms"
    header = statistics.median_low(
        [min(r["decision"]["prefix_blocks"].values(), default=0) for r in ok]
    )
    same = sum(_rescore(r["decision"], "as run") == r["decision"]["endpoints"][0] for r in ok)
    kept: collections.Counter = collections.Counter()
    lost: collections.Counter = collections.Counter()
    for r in ok:
        d = r["decision"]
        holder = _holder(d)
        if holder is None or max(d["prefix_blocks"].values()) < header + 10:
            continue
        if holder not in d["terms"][TTFT]:
            continue
        for o in OPTIONS:
            (kept if _rescore(d, o) == holder else lost)[o] += 1
    return f"re-scored as logged {same}/{len(ok)}; strong holder kept/lost: " + ", ".join(
        f"{o} {kept[o]}/{lost[o]}" for o in OPTIONS
    )


def _ttft_costs(t: dict[str, dict], charged: bool) -> dict[str, float]:
    """The cost predicted TTFT scored each candidate by (as `score` adds it up)."""
    return {
        a: x["predicted_s"] + x["eviction_s"] - x.get("kv_fit_margin_s", 0.0)
        + (x.get("spill_cost_s", 0.0) if charged else 0.0)
        for a, x in t.items()
    }  # fmt: skip


def _pick_without_charge(d: dict) -> str | None:
    """The endpoint the totals pick with predicted TTFT's score recomputed without the spill
    charge (the other scorers' scores as logged); None when the terms, with the charge, do
    not re-derive the logged pick (explain runs just after score: queues drained between)."""
    terms, scores = d["terms"][TTFT], d["scores"]
    total = scores.get("default/total", {})
    ttft = scores.get(TTFT, {})
    if not total or set(ttft) != set(terms):
        return None
    w = WEIGHTS["predicted-ttft-scorer"]
    with_c, without = _ttft_costs(terms, True), _ttft_costs(terms, False)
    b1, b0 = min(with_c.values()), min(without.values())
    rest = {a: total[a] - w * ttft[a] for a in terms}
    again = {a: rest[a] + w * b1 / with_c[a] for a in terms}
    if max(again, key=lambda a: again[a]) != d["endpoints"][0]:
        return None
    moved = {a: rest[a] + w * b0 / without[a] for a in terms}
    return max(moved, key=lambda a: moved[a])


def charged(rows: list[dict]) -> list[str]:
    ok = [r for r in _ok(rows) if TTFT in r["decision"].get("terms", {})]
    ok = [r for r in ok if any("spill_cost_s" in t for t in r["decision"]["terms"][TTFT].values())]
    if not ok:
        return ["no decisions with spill_cost_s terms"]
    ttfts = [r["ttft_s"] for r in ok]
    per: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    seen, real_busy, h_pred, h_real, moved_ttft, alt_real = [], [], [], [], [], []
    for r in ok:
        d = r["decision"]
        per[d.get("picker", 0)]["decisions"] += 1
        alt = _pick_without_charge(d)
        if alt is None:
            per[d.get("picker", 0)]["not re-derived"] += 1
            continue
        pick = d["endpoints"][0]
        if alt == pick:
            continue
        holder = _holder(d)
        c = per[d.get("picker", 0)]
        c["moved"] += 1
        c["kept holder" if pick == holder else "left holder"] += 1
        terms = d["terms"][TTFT]
        seen.append(next(iter(terms.values()))["fleet_busy"])
        backlog = {a: real_backlog(rows, a, r["sent_s"]) for a in terms}
        real_busy.append(sum(b > 1e-3 for b in backlog.values()) / len(terms))
        t = terms[pick]
        real_prefill = r["prompt_tokens"] * (
            1 - d["prefix_blocks"].get(pick, 0) / d["request_blocks"]
        )
        scale = real_prefill / ENGINE_TPS / t["uncached_s"] if t["uncached_s"] > 0 else 1.0
        h_pred.append(t["queue_s"] * scale)
        h_real.append(backlog[pick])
        alt_real.append(backlog[alt])
        moved_ttft.append(r["ttft_s"])
    out = [
        f"picker {p}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
        for p, c in sorted(per.items())
    ]
    if seen:
        m, q = statistics.mean, lambda xs, k: sorted(xs)[min(len(xs) - 1, int(k * len(xs)))]
        out.append(
            f"{len(seen)} moved: busy share seen {m(seen):.2f}, "
            f"really backlogged {m(real_busy):.2f}; "
            f"the pick's queue predicted {m(h_pred):.3f} s, real {m(h_real):.3f} s; the "
            f"uncharged pick's real backlog {m(alt_real):.3f} s; moved TTFT p50 / p90 "
            f"{q(moved_ttft, 0.5):.3f} / {q(moved_ttft, 0.9):.3f} s against the run's "
            f"{q(ttfts, 0.5):.3f} / {q(ttfts, 0.9):.3f} s"
        )
    return out


def main(argv: list[str]) -> int:
    cut = float(argv[argv.index("--phases") + 1]) if "--phases" in argv else None
    rep = Path(argv[argv.index("--replayed") + 1]) if "--replayed" in argv else None
    every = float(argv[argv.index("--exchange") + 1]) if "--exchange" in argv else None
    valued = ("--phases", "--replayed", "--exchange")
    paths = [a for i, a in enumerate(argv)
             if not a.startswith("--") and (i == 0 or argv[i - 1] not in valued)]  # fmt: skip
    for path in paths:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        print(f"{path}:")
        if cut is not None:
            for line in phases(rows, cut):
                print(f"  {line}")
        if "--sides" in argv:
            print(f"  {sides(rows)}")
        if "--rescore" in argv:
            print(f"  {rescore(rows)}")
        if "--charged" in argv:
            for line in charged(rows):
                print(f"  {line}")
        if every is not None:
            print(f"  {exchange_shows(rows, every)}")
        if rep is not None:
            for k in sorted(rep.glob(f"{Path(path).stem}-replay*.jsonl")):
                rrows = [json.loads(line) for line in k.read_text().splitlines()]
                for line in replayed(rows, rrows):
                    print(f"  {k.name} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
