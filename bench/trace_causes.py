"""Why each request of a tenants trace missed the cache, from `bench/trace_routing.py`'s rows
(one JSON line per request, with the picker's `x-extproc-decision`).

    uv run python bench/trace_causes.py trace/tenants-approximate-0.jsonl [...]

A request missed when the engine served under half its prompt from cache. Causes, in order:
- new tenant: the tenant's first request (no router could hit);
- spill, holder lost on score: the index credited another endpoint with more of the prompt
  (beyond the header every tenant shares) and it was a candidate, but scored lower;
- spill, holder filtered out: that endpoint was removed by a filter;
- index credited chosen: the index credited the chosen endpoint, the engine had evicted it;
- known tenant evicted everywhere: the index credited nobody with more than the header;
- known tenant, lookup degraded: the index did not answer in time (a Redis index), so it
  credited nobody either (counted before the spills and evictions).
Printed per file with how many of each are at or above the run's TTFT p90. For runs with
several picker replicas (the decision names its `picker`), `--replicas` also splits each
cause by whether the tenant's previous request was decided by the same or another replica,
and counts the misses a lag could explain: a known tenant the index credits nobody with
whose previous request was sent under `LAG_S` before (placed, but not yet seen, or only
just) and lookups answered degraded. `--moves` (agentic traces) lists each turn that left
its session's previous server: the prefix blocks the index credited the old and the new
server with, and each scorer's score for the new server minus the old one (the scorer
with the largest difference "decided"), or the filter that removed the old one.
`--spills` (tenants traces) lists each "holder lost on score" spill: the weighted score
difference per scorer (chosen minus holder, the default profile's weights unless `--weights
'{"predicted-ttft-scorer": 4, ...}'`), the scorers without which the holder would have won
("tipped"), predicted TTFT's terms on the holder and the chosen server when the trace has
them (`terms`, explained decisions), and the holder's real prefill backlog at the decision,
reconstructed from the trace: the latest first token of a request sent to it earlier, less
the decision's time (its lane serves prefills first come first served).
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path

CAUSES = (
    "new tenant",
    "known tenant, evicted everywhere (index credits nobody)",
    "spill: index holder lost on score",
    "spill: index holder filtered out",
    "index credited chosen, engine had evicted",
    "hit",
    "known tenant, lookup degraded (the index answered nothing)",
)


def cause_of_each(rows: list[dict]) -> dict[int, str]:
    """Each decided request's cause (by its `index`), in send order."""
    rows = sorted(rows, key=lambda r: r["sent_s"])
    ok = [r for r in rows if r.get("decision") and "ttft_s" in r]
    # Blocks every tenant shares (the chat header): what the index credits every endpoint with
    # on most requests (the first few, before any placement, see less).
    minima = [min(r["decision"]["prefix_blocks"].values(), default=0) for r in ok]
    header = statistics.median_low(minima) if minima else 0
    seen: set[int] = set()
    out: dict[int, str] = {}
    for r in ok:
        d = r["decision"]
        held, scored = d["prefix_blocks"], d["scores"].get("default/total", {})
        best, mine = max(held.values(), default=0), held.get(r["served_by"], 0)
        if r.get("cached_tokens", 0) >= 0.5 * r.get("prompt_tokens", 0):
            cause = CAUSES[5]
        elif r["tenant"] not in seen:
            cause = CAUSES[0]
        elif d.get("index_degraded"):
            cause = CAUSES[6]
        elif best > header and mine < best:
            holders = [a for a, n in held.items() if n == best]
            cause = CAUSES[2] if any(h in scored for h in holders) else CAUSES[3]
        elif mine > header:
            cause = CAUSES[4]
        else:
            cause = CAUSES[1]
        out[r["index"]] = cause
        seen.add(r["tenant"])
    return out


def classify(rows: list[dict]) -> tuple[collections.Counter, collections.Counter, float]:
    ok = [r for r in rows if r.get("decision") and "ttft_s" in r]
    ttfts = sorted(r["ttft_s"] for r in ok)
    p90 = ttfts[int(0.9 * len(ttfts))] if ttfts else float("nan")
    cause = cause_of_each(rows)
    causes: collections.Counter = collections.Counter(cause.values())
    slow: collections.Counter = collections.Counter(
        cause[r["index"]] for r in ok if r["ttft_s"] >= p90
    )
    return causes, slow, p90


LAG_S = 0.5


def by_replica(rows: list[dict]) -> collections.Counter:
    """Each miss's cause, keyed with whether the tenant's previous request was decided by the
    same replica, and with the lag suspects and degraded lookups counted apart."""
    rows = sorted((r for r in rows if r.get("decision") and "ttft_s" in r),
                  key=lambda r: r["sent_s"])  # fmt: skip
    minima = [min(r["decision"]["prefix_blocks"].values(), default=0) for r in rows]
    header = statistics.median_low(minima) if minima else 0
    last: dict[int, dict] = {}
    out: collections.Counter = collections.Counter()
    for r in rows:
        d, prev = r["decision"], last.get(r["tenant"])
        last[r["tenant"]] = r
        missed = r.get("cached_tokens", 0) < 0.5 * r.get("prompt_tokens", 0)
        if prev is None:
            continue
        same = "same replica" if prev["decision"].get("picker") == d.get("picker") else "other"
        out[f"known tenant, previous decided by {same}"] += 1
        if d.get("index_degraded"):
            out[f"degraded lookup ({'miss' if missed else 'hit'})"] += 1
        if not missed:
            continue
        out[f"miss, previous decided by {same}"] += 1
        held = d["prefix_blocks"]
        if max(held.values(), default=0) <= header and r["sent_s"] - prev["sent_s"] < LAG_S:
            out[f"miss, index credits nobody, previous < {LAG_S} s before ({same})"] += 1
        recent = r["sent_s"] - prev["sent_s"] < LAG_S
        if recent and held.get(prev.get("served_by", ""), 0) <= header:
            out[f"miss, previous's server not credited, < {LAG_S} s ({same})"] += 1
    return out


def moves(rows: list[dict]) -> list[str]:
    """Each turn of a session served elsewhere than its previous turn, and why."""
    last: dict[int, str] = {}
    out: list[str] = []
    for r in sorted(rows, key=lambda r: (r["group"], r["turn"])):
        d, new = r.get("decision"), r.get("served_by")
        old = last.get(r["group"])
        if d and new and old and new != old:
            total = d["scores"].get("default/total", {})
            held = d["prefix_blocks"]
            where = f"session {r['group']} turn {r['turn']}: blocks {held.get(old, 0):g} -> "
            where += f"{held.get(new, 0):g} of {d['request_blocks']}"
            if d.get("index_degraded"):
                where += ", lookup degraded"
            if old not in total:
                why = "; ".join(x for x in d["reasons"] if old in x) or "; ".join(d["reasons"])
                out.append(f"{where}, old server filtered out: {why}")
            else:
                diffs = {
                    k.split("/")[-1]: round(v.get(new, 0.0) - v.get(old, 0.0), 3)
                    for k, v in d["scores"].items()
                    if k != "default/total"
                }
                top = max(diffs, key=lambda k: diffs[k])
                out.append(f"{where}, decided by {top}; new - old: {diffs}")
        if new:
            last[r["group"]] = new
    return out


def _weights(argv: list[str]) -> dict[str, float]:
    if "--weights" in argv:
        return json.loads(argv[argv.index("--weights") + 1])
    from extproc.scheduling.config import default_config

    (profile,) = default_config().schedulingProfiles
    return {r.pluginRef: r.weight or 1.0 for r in profile.plugins if r.weight is not None}


def real_backlog(rows: list[dict], address: str, at_s: float) -> float:
    """Seconds of prefill the engine at `address` still had ahead of a request arriving at
    `at_s`: the latest first token of the requests sent to it before, less `at_s`."""
    ends = [
        r["sent_s"] + r["ttft_s"] for r in rows
        if r.get("served_by") == address and "ttft_s" in r and r["sent_s"] < at_s
    ]  # fmt: skip
    return max(0.0, max(ends, default=0.0) - at_s)


_QUEUE_TERMS = ("virtual_queue_s", "inflight_floor_s", "waiting_floor_s", "peers_pending_s")
_TERMS = ("queue_s", "virtual_queue_s", "inflight_floor_s", "peers_pending_s",
          "waiting_floor_s", "uncached_s", "eviction_s", "predicted_s")  # fmt: skip


def _terms_line(t: dict) -> str:
    """Predicted TTFT's terms and inputs for one server, one line."""
    return (
        ", ".join(f"{k.removesuffix('_s')} {t[k]:.3f}" for k in _TERMS if k in t)
        + f" | waiting {t['waiting']:g} running {t['running']:g} kv {t['kv_usage']:.2f}"
        f" inflight {t['inflight_requests']:g}/{t['inflight_tokens']:g} tok"
    )


def spills(rows: list[dict], weights: dict[str, float]) -> tuple[list[str], collections.Counter]:
    """Each spill off a holder that lost on score: why, line by line, and a tally of the
    scorers that tipped them and of the term that set the holder's predicted queue."""
    cause = cause_of_each(rows)
    by_addr: dict[str, str] = {}
    lines: list[str] = []
    tally: collections.Counter = collections.Counter()
    for r in sorted(rows, key=lambda r: r["sent_s"]):
        if cause.get(r["index"]) != CAUSES[2]:
            continue
        d, new = r["decision"], r["served_by"]
        held, total = d["prefix_blocks"], d["scores"]["default/total"]
        best = max(held.values())
        holder = max((a for a, n in held.items() if n == best and a in total),
                     key=lambda a: total[a])  # fmt: skip
        short = lambda a: by_addr.setdefault(a, f"s{len(by_addr)}")  # noqa: E731
        diffs = {
            k.split("/")[-1]: weights.get(k.split("/")[-1], 1.0)
            * (v.get(new, 0.0) - v.get(holder, 0.0))
            for k, v in d["scores"].items() if k != "default/total"
        }  # fmt: skip
        margin = total[new] - total[holder]
        tipped = [k for k, x in diffs.items() if x > 0 and margin - x <= 0]
        tally.update(f"tipped by {k}" for k in tipped or ["several together"])
        line = (
            f"#{r['index']} t={r['sent_s']:.2f} tenant {r['tenant']} {short(holder)} "
            f"(blocks {held[holder]:g}) -> {short(new)} ({held.get(new, 0):g}) of "
            f"{d['request_blocks']}, margin {margin:.3f}, tipped by "
            f"{'+'.join(tipped) or 'several'}; "
            + ", ".join(f"{k} {x:+.3f}" for k, x in diffs.items() if abs(x) > 1e-3)
        )
        terms = d.get("terms", {}).get("default/predicted-ttft-scorer", {})
        if holder in terms and new in terms:
            h = terms[holder]
            queue = {k: h.get(k, 0.0) for k in _QUEUE_TERMS}
            setter = max(queue, key=lambda k: queue[k]) if max(queue.values()) > 0 else "none"
            tally[f"holder's queue set by {setter}"] += 1
            line += (
                "\n      holder: " + _terms_line(h) + "\n      chosen: " + _terms_line(terms[new])
            )
        real = real_backlog(rows, holder, r["sent_s"])
        line += f"\n      holder's real backlog {real:.3f} s; this TTFT {r['ttft_s']:.3f} s"
        lines.append(line)
    return lines, tally


def tenant_moves(rows: list[dict], weights: dict[str, float]) -> collections.Counter:
    """Every known tenant's request sent elsewhere than the tenant's previous request, by what
    moved it: the previous server ("home") removed by a filter (which one); home credited
    with no more than the shared header (the index took the tenant for new, no-hit spreading
    placed it); another server credited with as much as home (a second holder); or home
    credited and outscored, by the scorer that tipped it (for predicted TTFT, the term that
    set home's predicted queue). Each class counted with its misses (the engine served under
    half the prompt from cache) and its requests at or above the run's TTFT p90."""
    ok = sorted((r for r in rows if r.get("decision") and "ttft_s" in r),
                key=lambda r: r["sent_s"])  # fmt: skip
    minima = [min(r["decision"]["prefix_blocks"].values(), default=0) for r in ok]
    header = statistics.median_low(minima) if minima else 0
    ttfts = sorted(r["ttft_s"] for r in ok)
    p90 = ttfts[int(0.9 * len(ttfts))] if ttfts else float("nan")
    last: dict[int, str] = {}
    out: collections.Counter = collections.Counter()
    for r in ok:
        d, new, home = r["decision"], r["served_by"], last.get(r["tenant"])
        last[r["tenant"]] = new
        if home is None:
            continue
        out["known tenant requests"] += 1
        if new == home:
            continue
        held, total = d["prefix_blocks"], d["scores"].get("default/total", {})
        if home not in total:
            why = next((x.split(" ")[0] for x in d["reasons"] if home in x), "excluded")
            kind = f"home filtered out ({why.split('/')[-1]})"
        elif held.get(home, 0) <= header:
            kind = "home not credited beyond the header (dealt as new)"
        elif held.get(new, 0) >= held[home]:
            kind = "another holder credited with as much"
        else:
            diffs = {
                k.split("/")[-1]: weights.get(k.split("/")[-1], 1.0)
                * (v.get(new, 0.0) - v.get(home, 0.0))
                for k, v in d["scores"].items() if k != "default/total"
            }  # fmt: skip
            margin = total[new] - total[home]
            tipped = [k for k, x in diffs.items() if x > 0 and margin - x <= 0]
            kind = "home outscored, tipped by " + ("+".join(tipped) or "several")
            terms = d.get("terms", {}).get("default/predicted-ttft-scorer", {})
            if "predicted-ttft-scorer" in tipped and home in terms:
                queue = {k: terms[home].get(k, 0.0) for k in _QUEUE_TERMS}
                top = max(queue, key=lambda k: queue[k])
                kind += f" (home's queue set by {top if queue[top] > 0 else 'nothing'})"
        missed = r.get("cached_tokens", 0) < 0.5 * r.get("prompt_tokens", 1)
        out["moved"] += 1
        out[kind] += 1
        out[f"{kind}: missed"] += missed
        out[f"{kind}: at/above p90"] += r["ttft_s"] >= p90
    return out


def by_time(rows: list[dict], first_s: float = 5.0) -> list[str]:
    """Requests and their uncached prompt tokens per cause, all of the run and those sent in
    its first `first_s` seconds (where a replica's calibration transient falls)."""
    by = {r["index"]: r for r in rows}
    n: collections.Counter = collections.Counter()
    early: collections.Counter = collections.Counter()
    tokens: collections.Counter = collections.Counter()
    for index, cause in cause_of_each(rows).items():
        r, c = by[index], cause.split(" (")[0]
        n[c] += 1
        early[c] += r["sent_s"] < first_s
        tokens[c] += r.get("prompt_tokens", 0) - r.get("cached_tokens", 0)
    return [
        f"{n[c]:4d} (first {first_s:g} s {early[c]:3d}), uncached tokens {tokens[c]:7d}  {c}"
        for c in sorted(n, key=lambda c: -tokens[c])
    ]


def main(argv: list[str]) -> int:
    replicas = "--replicas" in argv
    if "--moves" in argv:
        for path in (a for a in argv if not a.startswith("--")):
            rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
            found = moves(rows)
            print(f"{path}: {len(found)} turns left their session's server")
            for line in found:
                print(f"  {line}")
        return 0
    if "--tenant-moves" in argv:
        weights = _weights(argv)
        paths = [a for i, a in enumerate(argv) if not a.startswith("--")
                 and (i == 0 or argv[i - 1] != "--weights")]  # fmt: skip
        for path in paths:
            rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
            print(path)
            for k, n in sorted(tenant_moves(rows, weights).items()):
                print(f"  {n:4d}  {k}")
        return 0
    if "--spills" in argv:
        weights = _weights(argv)
        paths = [a for i, a in enumerate(argv) if not a.startswith("--")
                 and (i == 0 or argv[i - 1] != "--weights")]  # fmt: skip
        for path in paths:
            rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
            found, tally = spills(rows, weights)
            print(f"{path}: {len(found)} spills off a holder that lost on score")
            for line in found:
                print(f"  {line}")
            for k, n in sorted(tally.items()):
                print(f"  {n:4d}  {k}")
        return 0
    early = "--early" in argv
    argv = [a for a in argv if a not in ("--replicas", "--early")]
    if early:
        for path in argv:
            rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
            print(f"{path}:")
            for line in by_time(rows):
                print(f"  {line}")
        return 0
    for path in argv:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        causes, slow, p90 = classify(rows)
        prompt = sum(r.get("prompt_tokens", 0) for r in rows)
        cached = sum(r.get("cached_tokens", 0) for r in rows)
        print(f"{path}: hit {cached / max(prompt, 1):.1%}, TTFT p90 {p90:.3f} s")
        for cause in CAUSES:
            print(f"  {causes[cause]:4d} ({slow[cause]:3d} at or above p90)  {cause}")
        if replicas:
            for key, n in sorted(by_replica(rows).items()):
                print(f"  {n:4d}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
