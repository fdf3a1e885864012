"""Why each slow interactive request of an overload run was slow, by mechanism (issue 15,
twenty-eighth session).

    .venv/bin/python bench/trace_slow.py <bench_overload output> [...] [--runs J,J-gh]

Slow: a TTFT over 2x the invocation's unloaded p99. Needs `--trace` runs: from `all_trace`
(every served request: arrival, band, server, estimate, max_tokens, engine prompt tokens,
picker wait, engine arrival, KV wait, done) each server's books are rebuilt (a request
counts `estimate + max_tokens` from its release to its end + `ACCESS_LAG_S`, as the
concurrency detector counts it) and its engine's KV (whole blocks of prompt + max_tokens
from admission to done; trace_kvwait.py checked the rebuild against the simulator's own
`kv_arrival`); the reserve and the refill credit come from the run's timeline (the sample
before the arrival; the credit the largest in the second before, when it was lent).

Classes, for each slow request:
- `early`: arrived in the first `EARLY_S` (the lane behind batch placed before the first
  interactive arrival: the gate's activeAtStart);
- with a picker wait (>= `WAIT_S`) and no server with room for it by the books at its
  arrival: its clump (its own tokens and the band's arrivals within `CLUMP_S` before it, the
  joint spike term's unit) against the reserve R and what the credit left kept K = R - credit:
  `over` (clump > R: the band's burst beyond the whole reserve), `lent` (K < clump <= R: the
  credit lent what it needed), `held` (clump <= K: earlier work held the room);
- `hol`: a picker wait though a server had room for it by the books (behind a request at the
  band's head that fit nowhere);
- with a KV wait (>= `WAIT_S`) and no picker wait: `steer` (the other server had room for it
  by the books and in its engine: the least-unfinished-prefill steer chose the fuller one),
  `unit` (no other server with room: the engine held more than the books counted);
- `lane`: none of these (prefill lane or the machine).
A `+kv` suffix: after its picker wait it also waited for KV (released on the books' room
before the engine had it). Without a timeline (the bench writes it under /tmp) the room
waits are `room` (said once per run).

The books and the engine's KV count the requests an `-ev` run cut (bench/trace_cut.py: the
row's `cut_trace`, or for older rows rebuilt from the run's Envoy access log and timeline),
each from its release to the cut; `--without-cut` leaves them out (the tool's figures
before the evshort branch).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
from dataclasses import dataclass
from pathlib import Path

from trace_cut import cut_trace  # bench/ is on the path
from trace_kvwait import ACCESS_LAG_S, BLOCK, USABLE, blocks, runs

EARLY_S = 1.5
WAIT_S = 0.1
CLUMP_S = 0.3  # the runs' reserve_spike_s (`-spike300`)
KV_BLOCKS = 700  # one server's KV (the bench's --num-gpu-blocks)


@dataclass(frozen=True, slots=True)
class Req:
    at: float
    band: int
    ep: str
    tokens: int  # as the books count it: estimate + max_tokens
    kv_blocks: int  # as the engine holds it
    released: float
    admitted: float  # into the engine's KV
    arrived: float  # at the engine
    done: float


def rebuild(all_trace: list[list]) -> list[Req]:
    out = []
    for at, band, ep, est, mx, prompt, wait, to_srv, kv, done in all_trace:
        if to_srv < 0 or kv < 0:
            continue
        out.append(Req(at, band, ep, est + mx, blocks(prompt + mx - 1), at + wait,
                       at + to_srv + kv, at + to_srv, done))  # fmt: skip
    return out


def booked(reqs: list[Req], ep: str, t: float, me: Req) -> int:
    """Tokens the books count on `ep` at `t`, `me` left out."""
    return sum(
        q.tokens
        for q in reqs
        if q.ep == ep and q is not me and q.released < t and q.done + ACCESS_LAG_S > t
    )


def engine_free(reqs: list[Req], ep: str, t: float, me: Req) -> int:
    """Blocks free on `ep`'s engine at `t` less those of the requests queued there for KV."""
    used = sum(q.kv_blocks for q in reqs if q.ep == ep and q is not me and q.arrived < t < q.done)
    return USABLE - used


class Timeline:
    """The run's samples: reserve and refill credit (the first picker's) over time."""

    def __init__(self, path: Path) -> None:
        rows = [json.loads(x) for x in path.read_text().splitlines() if x and "error" not in x]
        self.t = [r["t"] for r in rows]
        self.reserve = [_first(r, "reserved") for r in rows]
        self.credit = [_first(r, "refill") for r in rows]

    def at(self, t: float) -> tuple[int, int]:
        """(reserve at the sample before `t`, the largest credit in the second before)."""
        i = max(0, bisect.bisect_right(self.t, t) - 1)
        j = min(i, bisect.bisect_left(self.t, t - 1.0))
        return self.reserve[i], max(self.credit[j : i + 1])


def _first(row: dict, key: str) -> int:
    each = row.get(f"{key}_each")
    return int(each[0]) if each else int(row.get(key, 0))


def classify(t: dict, reqs: list[Req], cap: float, timeline: Timeline | None) -> tuple[str, dict]:
    """The class of one slow interactive request (`hi_trace` entry `t`) and its figures."""
    if t["at"] < EARLY_S:
        return "early", {}
    me = min((q for q in reqs if q.band == 1), key=lambda q: abs(q.at - t["at"]))
    eps = sorted({q.ep for q in reqs})
    wait = t.get("wait") or 0.0
    kv = (t.get("engine") or [0.0])[0]
    if wait >= WAIT_S:
        free = max(cap - booked(reqs, ep, me.at, me) for ep in eps)
        info: dict = {"free": round(free), "need": me.tokens}
        if free >= me.tokens:
            kind = "hol"
        elif timeline is None:
            kind = "room"
        else:
            reserve, credit = timeline.at(me.at)
            clump = me.tokens + sum(
                q.tokens
                for q in reqs
                if q.band == 1 and q is not me and 0 <= me.at - q.at < CLUMP_S
            )
            kept = max(0, reserve - credit)
            info |= {"clump": clump, "reserve": reserve, "kept": kept}
            kind = "over" if clump > reserve else "lent" if clump > kept else "held"
        return kind + ("+kv" if kv >= WAIT_S else ""), info
    if kv >= WAIT_S:
        other = [ep for ep in eps if ep != t["endpoint"]]
        room = [
            ep
            for ep in other
            if booked(reqs, ep, me.released, me) + me.tokens <= cap
            and engine_free(reqs, ep, me.arrived, me) >= me.kv_blocks
        ]
        return ("steer" if room else "unit"), {"other_room": room}
    return "lane", {}


def unloaded_p99(path: Path) -> float | None:
    for line in path.read_text().splitlines():
        if line.startswith('{"capacity'):
            return float(json.loads(line)["unloaded_ttft_p99"])
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--runs", default="", help="only runs whose name ends with one of these")
    ap.add_argument("--without-cut", action="store_true", help="books of served requests only")
    args = ap.parse_args()
    wanted = [r for r in args.runs.split(",") if r]
    totals: dict[str, collections.Counter[str]] = {}
    for path in args.paths:
        unloaded = unloaded_p99(path)
        if unloaded is None:
            print(f"{path}: no unloaded p99 (the bench's last row)")
            continue
        for row, frac in runs(str(path)):
            name = row["run"].removeprefix("flow control ")
            if wanted and not any(name.endswith(w) for w in wanted):
                continue
            if frac is None or not row.get("all_trace"):
                print(f"{path} {name}: no --trace rows or estimate ratio; skipped")
                continue
            tl_path = Path(row.get("timeline") or "")
            timeline = Timeline(tl_path) if tl_path.is_file() else None
            if timeline is None:
                print(f"{path} {name}: timeline {tl_path} gone: room waits not split")
            cut: list[list] = []
            if not args.without_cut:
                cut, how = cut_trace(row)
                if len(cut) != row.get("evicted", 0):
                    print(f"{path} {name}: {row.get('evicted')} cut, not counted: {how}")
            reqs = rebuild(row["all_trace"] + cut)
            cap = frac * KV_BLOCKS * BLOCK
            counts = totals.setdefault(name, collections.Counter())
            counts["runs"] += 1
            for t in row["hi_trace"]:
                if not t.get("ttft") or t["ttft"] <= 2 * unloaded:
                    continue
                kind, info = classify(t, reqs, cap, timeline)
                counts[kind.removesuffix("+kv")] += 1
                print(f"{path.name} {name} {t['at']:6.2f} {t['tenant']} {kind:8s} "
                      f"{t['ttft'] / unloaded:.2f}x wait {t.get('wait') or 0:.2f} "
                      f"kv {(t.get('engine') or [0])[0]:.2f} {json.dumps(info)}")  # fmt: skip
    for name, counts in totals.items():
        n = counts.pop("runs")
        print(f"== {name}: {n} runs, " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
