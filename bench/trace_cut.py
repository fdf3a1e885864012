"""The requests an `-ev` overload run cut, in `all_trace`'s form, so that the rebuilt books
and engine KV (bench/trace_slow.py) count them: a cut request held its room on the books and
its KV from its release until the cut.

    .venv/bin/python bench/trace_cut.py <bench_overload output> [...]   # what was rebuilt

A row with `cut_trace` (bench_overload.py --trace since the evshort branch) lists them as
`all_trace` does, `done` the client's end of the cut stream; their engine prompt tokens are
unknown (no usage chunk came) and are taken from the served requests of the same estimate
(one tenant), and a cut before the engine's timing line came gets the served batch
requests' median send time. The client sees a cut 1.00 s after it happened (0.995-1.008 s
after Envoy's access-log end in 651 cuts of the thirtieth session's K runs; served requests
2 ms: likely Envoy's delayed close of the downstream connection, 1 s by default), so when the
run's Envoy access log is still there each cut's `done` is its end there; without it the
client's end stays, and the word on how says so.

Older rows keep only `evicted_detail` (arrival, tenant, band, lines, seconds it ran). Their
run's Envoy access log (in the bench's temporary directory, next to the timeline) names
each request by its index (`x-bench-id`): the served ones, in index order, are `all_trace`'s
entries one for one (the alignment is checked: every endpoint agrees, the start times within
0.05 s of a single offset), and the cut ones (`details=evicted`) give their server, their
arrival and their end. What it does not give:
- when the picker released it: the timeline's `released_lo` per sample interval, less the
  served batch requests released in it, is how many cut ones were released then (the sums
  are checked to agree; the running count's dips of one or two, a release on the other
  side of a sample by the two clocks, are smoothed out); each cut request, oldest first,
  takes the earliest such release after its arrival, at the middle of its interval. Tried
  on served batch requests of 20 saved `-ev` runs as if cut (12 a run, their true release
  known): within 0.25 s for 70% of them, 0.5 s for 84%, at most 1.6 s (where two of them
  were released in the other order);
- its max_tokens (the bench draws it per request): the served batch requests' median;
- its engine prompt tokens: as above.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import re
import statistics
from collections.abc import Iterable
from pathlib import Path

from trace_kvwait import runs  # bench/ is on the path

_LINE = re.compile(
    r"^(\S+) id=(\d+) code=(\d+) flags=\S+ details=(\S+) .*?upstream=(\S+) .*?dur=(\d+)"
)
_ALIGN_S = 0.05  # the served requests' Envoy start times against their arrivals


def _access(path: Path) -> list[tuple[int, float, int, str, str, float]]:
    """(id, start, code, details, upstream, seconds) of each burst request, by id."""
    out = []
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        ts, i, code, details, upstream, dur = m.groups()
        start = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        out.append((int(i), start, int(code), details, upstream, int(dur) / 1000))
    out.sort()
    return out


def _median(values: Iterable[float], default: float) -> float:
    got = list(values)
    return statistics.median(got) if got else default


class _Fill:
    """What the served requests say of the figures a cut request's trace lacks."""

    def __init__(self, all_trace: list[list]) -> None:
        batch = [e for e in all_trace if e[1] == 0 and e[7] >= 0]
        self.max_tokens = round(_median((e[4] for e in batch), 0))
        self.send = _median((e[7] - e[6] for e in batch), 0.0)  # release to engine arrival
        by_est: dict[int, list[int]] = {}
        for e in all_trace:
            by_est.setdefault(e[3], []).append(e[5])
        self.prompt = {est: round(statistics.median(p)) for est, p in by_est.items()}

    def prompt_of(self, est: int) -> int:
        if est in self.prompt:
            return self.prompt[est]
        near = min(self.prompt, key=lambda e: abs(e - est))  # an estimate no served one had
        return self.prompt[near]


def from_saved(row: dict) -> tuple[list[list], str]:
    """A row's own `cut_trace`, its unknowns filled, each cut at its end in the run's Envoy
    access log when that is still there; and a word on how."""
    fill = _Fill(row["all_trace"])
    found = _aligned(row)
    ends: list[tuple[float, float, str]] = []
    if isinstance(found, str):
        how = f"saved; cut at the client's end, ~1 s late ({found})"
    else:
        name, offset, lines = found
        ends = [(x[1] - offset, x[1] - offset + x[5], x[4]) for x in lines if x[3] == "evicted"]
        how = f"saved; cut at its end in {name}"
    out = []
    late = 0
    for at, band, ep, est, mx, prompt, wait, to_srv, kv, done in row["cut_trace"]:
        if not ep:
            continue  # no server named (a 429 without the decision): not counted
        prompt = prompt or fill.prompt_of(est)
        to_srv = to_srv if to_srv >= 0 else wait + fill.send
        if ends:
            start, end, upstream = min(ends, key=lambda e: abs(e[0] - at))
            if abs(start - at) <= _ALIGN_S and upstream == ep:
                done = round(end, 3)
            else:
                late += 1
        out.append([at, band, ep, est, mx, prompt, wait, to_srv, max(kv, 0.0), done])
    if late:
        how += f"; {late} not in it, cut at the client's end"
    return out, how


def _aligned(row: dict) -> tuple[str, float, list[tuple[int, float, int, str, str, float]]] | str:
    """The run's Envoy access log whose served requests are `all_trace`'s one for one (every
    endpoint agrees, the start times within `_ALIGN_S` of a single offset): its name, that
    offset (Envoy's clock less the run's) and its lines; a string says why not."""
    timeline = Path(row.get("timeline") or "")
    if not timeline.is_file():
        return f"timeline {timeline} gone"
    trace = row["all_trace"]
    for log in sorted(timeline.parent.glob("envoy-access-*.log")):
        lines = _access(log)
        served = [x for x in lines if x[2] == 200 and x[3] == "via_upstream"]
        if len(served) != len(trace):
            continue
        if any(s[4] != e[2] for s, e in zip(served, trace, strict=True)):
            continue
        gaps = [s[1] - e[0] for s, e in zip(served, trace, strict=True)]
        offset = statistics.median(gaps)
        if max(abs(g - offset) for g in gaps) > _ALIGN_S:
            continue
        return log.name, offset, lines
    return "no access log in the run's directory matches its served requests"


def _releases(row: dict, cut: list[tuple[float, float]], timeline: Path) -> list[float] | str:
    """The release time of each cut request ((arrival, end), by arrival) from the timeline's
    per-interval batch releases; a string says why not."""
    rows = [json.loads(x) for x in timeline.read_text().splitlines() if x and "error" not in x]
    t = [r["t"] for r in rows]
    per = [r.get("released_lo", 0) for r in rows]
    served = [0] * len(t)
    for e in row["all_trace"]:
        if e[1] == 0:
            # Sample i counts the releases since sample i - 1.
            served[bisect.bisect_left(t, e[0] + e[6], hi=len(t) - 1)] += 1
    if sum(per) != sum(served) + len(cut):
        return f"released_lo {sum(per)} != served batch {sum(served)} + cut {len(cut)}"
    # Cut ones released by sample i: the surplus so far. A release near a sample's time
    # falls on either side of it by the two clocks (the client's arrival plus the picker's
    # wait, the sampler's), so the surplus dips by one or two now and then: its running
    # maximum is the count.
    slots: list[float] = []  # the k-th cut release's time
    surplus = 0
    for i in range(len(t)):
        surplus += per[i] - served[i]
        while len(slots) < min(surplus, len(cut)):
            slots.append(((t[i - 1] if i else 0.0) + t[i]) / 2)
    out = []
    for at, end in cut:
        k = next((k for k, r in enumerate(slots) if at < r), None)
        if k is None:
            return f"no cut release left after {at:.2f} s"
        out.append(min(max(at, slots.pop(k)), end))
    return out


def rebuilt(row: dict) -> tuple[list[list], str]:
    """The cut requests of an older `-ev` row from its Envoy access log and timeline, and a
    word on how (or why not)."""
    if not row.get("evicted"):
        return [], "none cut"
    found = _aligned(row)
    if isinstance(found, str):
        return [], found
    name, offset, lines = found
    timeline = Path(row["timeline"])
    trace = row["all_trace"]
    cut = [x for x in lines if x[3] == "evicted"]
    if len(cut) != row["evicted"]:
        return [], f"{name}: {len(cut)} evicted, the row says {row['evicted']}"
    details = list(row["evicted_detail"])
    est_of = {h["tenant"]: h["est"] for h in row["hi_trace"]}
    spans = sorted((x[1] - offset, x[1] - offset + x[5], x) for x in cut)
    releases = _releases(row, [(a, b) for a, b, _ in spans], timeline)
    if isinstance(releases, str):
        return [], releases
    fill = _Fill(trace)
    out = []
    for (at, end, x), rel in zip(spans, releases, strict=True):
        detail = min(details, key=lambda d: abs(d[0] - at), default=None)
        if detail is None or abs(detail[0] - at) > _ALIGN_S or detail[1] not in est_of:
            return [], f"{name}: the cut at {at:.2f} s is not in evicted_detail"
        details.remove(detail)
        band = 1 if detail[2] == "interactive" else 0
        est = est_of[detail[1]]
        w = round(rel - at, 4)
        out.append([round(at, 3), band, x[4], est, fill.max_tokens, fill.prompt_of(est),
                    w, round(w + fill.send, 4), 0.0, round(end, 3)])  # fmt: skip
    return out, f"rebuilt from {name} and the timeline"


def cut_trace(row: dict) -> tuple[list[list], str]:
    """The cut requests of one run in `all_trace`'s form, and how they were got."""
    if "cut_trace" in row:
        return from_saved(row)
    return rebuilt(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path)
    for path in ap.parse_args().paths:
        for row, _ in runs(str(path), "all_trace"):
            cut, how = cut_trace(row)
            name = row["run"].removeprefix("flow control ")
            waits = [round(e[6], 2) for e in cut]
            print(f"{path.name} {name}: {len(cut)} of {row.get('evicted', 0)} cut, {how}; "
                  f"picker waits {waits}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
