"""Interactive requests that waited in the picker with `reserve_refill_s`: the reserve kept
for them, its spike term, the refill credit subtracted from it, and when the credited room
really came back (issue 15, twenty-second session).

    .venv/bin/python bench/trace_credit.py <bench_overload output> [--min-wait 0.1]

Rebuilt offline from a `--trace` run's `all_trace` (every served request: arrival, band,
server, estimate, max_tokens, ..., picker wait, ..., done): each request counts its picker
tokens (estimate + max_tokens) on its server from its release (arrival + picker wait) to
its end as the picker hears it (done + `ACCESS_LAG_S`). From that, per server and moment:
- the credit: the tokens that ended there over the last `WINDOW_S`, per second, times the
  horizon (flowcontrol/refill.py);
- the credit's outcome: the tokens that really ended there within the horizon after;
- the reserve: the size term (the largest of the band's last 100 requests; before 100, at
  least the prior's and the largest of any band) plus the spike term (the 0.9 quantile of
  the tokens the band sent within `SPIKE_S` before each of its last 100 arrivals, from the
  20th on); kept = reserve less the credit.

Two questions. Over every lower-band release (where the credit let lower work in): is the
credit right on average, and how often did less than it end within the horizon? Per
interactive request that waited over `--min-wait` after the band's 20th arrival: its clump
(the band's tokens that arrived within `SPIKE_S` before it) against the spike term, the
room on its server then against what it needed, the credit there when the clump began,
and how long the room it lacked took to end.
"""

from __future__ import annotations

import argparse
import bisect
import math

from trace_kvwait import runs  # bench/ is on the path

WINDOW_S = 3.0  # refill.py's window
HORIZON_S = 0.3  # the runs' reserve_refill_s (`-refill300`)
SPIKE_S = 0.3  # the runs' reserve_spike_s (`-spike300`)
SPIKE_Q = 0.9
HISTORY = 100
TRUSTED = 20
PRIOR_TOKENS = 2683  # the runs' reserve_prior request_tokens (printed by the bench)
ACCESS_LAG_S = 0.02  # request end to the picker hearing it (`-ends20`)
KV_TOKENS = 700 * 16  # one server's KV (the bench's --num-gpu-blocks x block size)
SPEED_KEPT, SPEED_TRUSTED = 64, 8  # refill.py's, for the predicted credit


def rank(q: float, n: int) -> int:
    return max(0, math.ceil(q * n) - 1)


class Books:
    def __init__(self, rows: list[list]) -> None:
        self.reqs = []
        self.out: list[int] = []  # per request (in `reqs`' order): its max_tokens
        for at, band, ep, est, mx, _p, wait, _to, _kv, done in rows:
            self.reqs.append((at, band, ep, est + mx, at + wait, done + ACCESS_LAG_S))
            self.out.append(mx)
        # Per-output-token times (start to end), in the order the ends were heard.
        timed = sorted(
            (r[5], (r[5] - r[4]) / mx) for r, mx in zip(self.reqs, self.out, strict=True) if mx
        )
        self.timed_t = [e for e, _ in timed]
        self.timed = [x for _, x in timed]
        self.ends: dict[str, list[tuple[float, int]]] = {}
        for _at, _b, ep, tok, _rel, end in self.reqs:
            self.ends.setdefault(ep, []).append((end, tok))
        for v in self.ends.values():
            v.sort()
        self.end_t = {ep: [e for e, _ in v] for ep, v in self.ends.items()}
        self.cum = {}
        for ep, v in self.ends.items():
            c, s = [0], 0
            for _, t in v:
                s += t
                c.append(s)
            self.cum[ep] = c
        self.hi = sorted((at, tok) for at, band, _e, tok, _r, _d in self.reqs if band == 1)
        self.hi_t = [a for a, _ in self.hi]
        self.any_sorted = sorted(self.reqs)

    def ended(self, ep: str, t0: float, t1: float) -> int:
        """Tokens that ended on `ep` in (t0, t1]."""
        ts, c = self.end_t.get(ep, []), self.cum.get(ep, [0])
        return c[bisect.bisect_right(ts, t1)] - c[bisect.bisect_right(ts, t0)]

    def credit(self, ep: str, t: float) -> int:
        return int(self.ended(ep, t - WINDOW_S, t) / WINDOW_S * HORIZON_S)

    def predicted(self, ep: str, t: float) -> int:
        """The predicted credit (`reserve_refill_credit: predicted`): tokens on `ep` at `t`
        whose start + max_tokens x the median per-token time of the last `SPEED_KEPT` ends
        falls in (t, t + horizon]."""
        i = bisect.bisect_left(self.timed_t, t)
        recent = sorted(self.timed[max(0, i - SPEED_KEPT) : i])
        if len(recent) < SPEED_TRUSTED:
            return self.credit(ep, t)
        per_token = recent[len(recent) // 2]
        return sum(
            tok
            for (_a, _b, e, tok, rel, end), mx in zip(self.reqs, self.out, strict=True)
            if e == ep and rel <= t < end and t < rel + mx * per_token <= t + HORIZON_S
        )

    def until_freed(self, ep: str, t: float, tokens: int) -> float:
        """Seconds from `t` until `tokens` more had ended on `ep` (inf: never)."""
        ts, c = self.end_t.get(ep, []), self.cum.get(ep, [0])
        i = bisect.bisect_right(ts, t)
        j = bisect.bisect_left(c, c[i] + tokens, lo=i)
        return ts[j - 1] - t if j - 1 < len(ts) and j <= len(ts) else math.inf

    def books(self, ep: str, t: float) -> int:
        return sum(tok for _a, _b, e, tok, rel, end in self.reqs if e == ep and rel <= t < end)

    def reserve(self, t: float) -> tuple[int, int, int]:
        """(size term, spike term, band arrivals) as sized just before `t`."""
        n = bisect.bisect_left(self.hi_t, t)
        last = self.hi[max(0, n - HISTORY) : n]
        size = max((k for _, k in last), default=0)
        if n < HISTORY:
            lo = max(0, bisect.bisect_left([r[0] for r in self.any_sorted], t) - 2 * HISTORY)
            biggest = max((r[3] for r in self.any_sorted[lo:] if r[0] < t), default=0)
            size = max(size, PRIOR_TOKENS, biggest)
        spike = 0
        if n >= TRUSTED:
            aheads = []
            for i in range(max(0, n - HISTORY), n):
                at = self.hi[i][0]
                aheads.append(sum(k for a, k in self.hi[:i] if at - a < SPIKE_S))
            aheads.sort()
            spike = aheads[rank(SPIKE_Q, len(aheads))]
        return size, spike, n


def analyse(row: dict, frac: float, min_wait: float) -> None:
    b = Books(row["all_trace"])
    cap = frac * KV_TOKENS
    eps = sorted(b.ends)
    # 1. The credit over every lower-band release after 5 s (the burst's steady part):
    # ended within the horizon after it against the credit, for both ways of counting it.
    print(f"== {row['run'][13:]}  lanes {row.get('lanes')} load {row.get('load_avg')}")
    for name, credit_at in (("rate", b.credit), ("predicted", b.predicted)):
        n = given = short = half = 0
        over = got_sum = 0
        ratios = []
        for _at, band, ep, _tok, rel, _end in b.reqs:
            if band != 0 or rel < 5 or rel > 60:
                continue
            c, got = credit_at(ep, rel), b.ended(ep, rel, rel + HORIZON_S)
            n += 1
            given += c
            got_sum += got
            over += max(0, c - got)
            if c > 0:
                ratios.append(got / c)
                short += got < c
                half += got < c / 2
        ratios.sort()
        k = len(ratios)
        if k:
            print(
                f"  {name} credit at {n} batch releases (5-60 s): mean {given / n:.0f} tokens "
                f"(ended within {HORIZON_S} s: mean {got_sum / n:.0f}); over the {k} with a "
                f"credit, ended / credit mean {sum(ratios) / k:.2f}, median "
                f"{ratios[k // 2]:.2f}; less than the credit ended in {short / k:.0%}, less "
                f"than half in {half / k:.0%}; credited beyond what ended: {over / n:.0f} "
                "tokens on the mean"
            )
    # 2. The waits, with the credit the run's picker used (`-rfp`: predicted).
    predicted = row["run"].endswith("-rfp")
    own_credit = b.predicted if predicted else b.credit
    rows = []
    for at, band, ep, tok, rel, _end in b.reqs:
        wait = rel - at
        if band != 1 or wait <= min_wait:
            continue
        size, spike, nth = b.reserve(at)
        if nth < TRUSTED:
            continue
        clump = [(a, k) for a, k in b.hi if at - SPIKE_S < a < at]
        ahead = sum(k for _, k in clump)
        t0 = clump[0][0] if clump else at
        # At the clump's start: per server, room, credit, kept
        per = {}
        for e in eps:
            room0 = cap - b.books(e, t0 - 1e-6)
            credit0 = own_credit(e, t0)
            room = cap - b.books(e, at)
            per[e] = (room0, credit0, room)
        # The server with most room at the clump's start (the one the reserve held on).
        holder = max(eps, key=lambda e: per[e][0])
        room0, credit0, room = per[holder]
        best = max(eps, key=lambda e: per[e][2])
        lack = tok - per[best][2]
        got0 = b.ended(holder, t0, t0 + HORIZON_S)
        freed_in = b.until_freed(best, at, max(0, int(lack)))
        other = (b.credit if predicted else b.predicted)(holder, t0)
        rows.append((at, tok, wait, ahead, spike, size, credit0, room0, got0, lack, freed_in, ep))
        kept = size + spike - credit0
        print(
            f"  {at:6.2f} {tok:5d} tok waited {wait:.2f} s (to {ep[-5:]}): clump {ahead} "
            f"({len(clump)} ahead) vs spike {spike} ({'in' if ahead <= spike else 'OVER'}); "
            f"reserve {size}+{spike}={size + spike}, credit {credit0} -> kept {kept}; "
            f"holder {holder[-5:]} room at clump start {room0:.0f} "
            f"({'>=' if room0 >= kept else '<'} kept), ended there within {HORIZON_S} s {got0} "
            f"({'>=' if got0 >= credit0 else '<'} credit; the other way {other}); "
            f"on arrival best room "
            f"{per[best][2]:.0f}, lacked {lack:.0f}, freed in {freed_in:.2f} s"
        )
    inside = [r for r in rows if r[3] <= r[4]]
    over = [r for r in inside if r[8] < r[6]]
    print(
        f"  waits > {min_wait} s after the 20th arrival: {len(rows)}; clump inside the spike "
        f"term {len(inside)}; of those, less than the credit ended within {HORIZON_S} s of "
        f"the clump's start {len(over)}; of all, less than the credit ended then "
        f"{sum(r[8] < r[6] for r in rows)} (nothing {sum(r[8] == 0 < r[6] for r in rows)})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--min-wait", type=float, default=0.1)
    args = ap.parse_args()
    for path in args.paths:
        for row, frac in runs(path, "all_trace"):
            print(f"# {path}")
            analyse(row, frac or 1.246, args.min_wait)


if __name__ == "__main__":
    main()
