"""Each server's prefill steps rebuilt from an overload run, and what the slow interactive
requests waited for in them (issue 15, thirty-second session).

    .venv/bin/python bench/trace_steps.py <bench_overload output> [...] [--x 2.0] [--steps]

Needs `--trace` runs. Every served request (`all_trace`) and every cut one (`cut_trace`, via
bench/trace_cut.py: its end the cut) is admitted by its engine at arrival + KV wait (the
trace's own). Then the steps are planned as the simulator plans them: extproc/sim/steps.py's
`plan_step`, the default budget of 2048 tokens less one per decoding sequence, FCFS among
admitted prompts, each step timed by the sim's `TimingSettings` at the run's `--sim-speed`.
The sim's own handling of a cut is kept: a prompt cut before its step is dropped, but one
cut during its step keeps its chunk, so the step still runs its full length (vLLM cannot stop
a step under way either). The rebuild is checked against the sim's own timing of every
interactive request (`hi_trace`'s `engine`: KV wait, prefill-lane wait, prefill) and the
errors are printed per run.

For each interactive request over `--x` times the unloaded p99:
- its picker wait, KV wait, lane wait and prefill (the sim's timing);
- `ahead`: the step under way when its engine admitted it, per prompt in it (b = batch,
  I = interactive, x = cut later, with when relative to this request's release);
- `waited`: the steps it waited for; `steps`: how many steps its prefill took, and
  `with_i`, `with_b`: the interactive and batch prompt tokens it shared those steps with;
- `close`: the interactive requests released to the same server within 0.2 s of it;
- `other_idle`: whether another server's lane was idle at its release.
`--steps` prints the steps from its admission to its first token.

Per run it also counts the steps that held a batch prompt cut during that very step: the lane
time left in them after the cut (work thrown away that gives no interactive request its
first token sooner), and the interactive requests admitted on that server meanwhile.
"""

from __future__ import annotations

import argparse
import collections
import json
from dataclasses import dataclass, field

from trace_cut import cut_trace  # bench/ is on the path
from trace_kvwait import runs

from extproc.sim.steps import ChunkPolicy, Work, plan_step
from extproc.sim.timing import TimingSettings

CLOSE_S = 0.2
TENANTS = {423: "A", 1263: "B", 2523: "C"}  # the overload bench's estimates per tenant


@dataclass(slots=True)
class Req:
    """One request on one server, with what the rebuild finds for it."""

    id: str
    ep: str
    band: int
    at: float  # arrival at the picker (run seconds)
    rel: float  # released by the picker
    adm: float  # admitted by its engine
    prompt: int
    done: float  # served: its end; cut: the cut
    cut: bool
    left: int = 0
    start: float | None = None  # its first step's start
    first: float | None = None  # the end of its last prefill step (None: cut before)


@dataclass(frozen=True, slots=True)
class Step:
    start: float
    end: float
    chunks: tuple[tuple[Req, int], ...]


def requests(row: dict) -> list[Req]:
    """The row's served and cut requests that reached an engine (engine prompt tokens of a
    cut one: a served one's of the same estimate)."""
    cut, _ = cut_trace(row)
    prompt_of: dict[int, int] = {}
    for e in row["all_trace"]:
        prompt_of.setdefault(e[3], e[5])
    out = []
    for was_cut, entries in ((False, row["all_trace"]), (True, cut)):
        for at, band, ep, est, _mx, prompt, wait, to, kv, done in entries:
            if not ep or to < 0 or kv < 0:
                continue
            prompt = prompt or prompt_of.get(est) or round(est / 1.28)
            name = f"{'I' if band else 'b'}{TENANTS.get(est, '?')}{'x' if was_cut else ''}"
            out.append(Req(f"{name}@{at + wait:.3f}", ep, band, at, at + wait, at + to + kv,
                           prompt, done, was_cut))  # fmt: skip
    return out


def replay(reqs: list[Req], speed: float, budget: int = 2048) -> list[Step]:
    """One server's steps (see the module docstring); fills each request's start/first."""
    timing = TimingSettings(speed=speed)
    policy = ChunkPolicy(max_num_batched_tokens=budget)
    reqs = sorted(reqs, key=lambda r: r.adm)
    for r in reqs:
        r.left, r.start, r.first = r.prompt, None, None
    t, i, steps = 0.0, 0, []
    waiting: list[Req] = []
    running: list[Req] = []
    while i < len(reqs) or waiting or running:
        while i < len(reqs) and reqs[i].adm <= t + 1e-9:
            waiting.append(reqs[i])
            i += 1
        waiting = [r for r in waiting if r.done > t]  # cut before its step: never runs
        if not waiting and not running:
            if i >= len(reqs):
                break
            t = reqs[i].adm
            continue
        decoding = sum(1 for r in reqs[:i] if r.first is not None and r.first <= t < r.done)
        plan = plan_step(policy, [Work(r, r.left) for r in running],
                         [Work(r, r.left) for r in waiting], decoding, 2)  # fmt: skip
        if not plan:  # every token of the budget decoding: the next end frees one
            ends = [r.done for r in reqs[:i] if r.first is not None and r.done > t]
            if not ends:
                break
            t = min(ends)
            continue
        end = t + timing.prefill_s(sum(w.left for w in plan), 0, 0)
        for w in plan:
            r = w.item
            if r.start is None:
                r.start = t
                waiting.remove(r)
                running.append(r)
            r.left -= w.left
            if r.left <= 0:
                running.remove(r)
                if not r.cut or r.done >= end:  # one cut during this step gets none
                    r.first = end
        steps.append(Step(t, end, tuple((w.item, w.left) for w in plan)))
        t = end
    return steps


@dataclass
class Run:
    name: str
    base: float  # the invocation's unloaded p99
    reqs: list[Req]
    steps: dict[str, list[Step]]
    errors: list[tuple[float, float]] = field(default_factory=list)  # (lane, prefill) per hi


def rebuild(row: dict, base: float, speed: float) -> Run:
    reqs = requests(row)
    by: dict[str, list[Req]] = collections.defaultdict(list)
    for r in reqs:
        by[r.ep].append(r)
    run = Run(row["run"], base, reqs, {ep: replay(rs, speed) for ep, rs in by.items()})
    index = {(r.ep, round(r.at, 3)): r for r in reqs if r.band}
    for h in row["hi_trace"]:
        r = index.get((h["endpoint"], round(h["at"], 3)))
        if r is None or r.start is None or r.first is None or not h.get("engine"):
            continue
        _kv, lane, pre = h["engine"]
        run.errors.append((abs(r.start - r.adm - lane), abs(r.first - r.start - pre)))
    return run


def explain(run: Run, h: dict) -> dict | None:
    """One interactive request of `hi_trace` in the rebuilt steps (the module docstring)."""
    r = next((q for q in run.reqs if q.band and q.ep == h["endpoint"]
              and round(q.at, 3) == round(h["at"], 3)), None)  # fmt: skip
    if r is None or r.start is None or r.first is None:
        return None
    steps = run.steps[r.ep]
    ahead = next((s for s in steps if s.start < r.adm - 1e-6 < s.end), None)
    mine = [s for s in steps if any(q is r for q, _ in s.chunks)]
    others = [q for ep, st in run.steps.items() if ep != r.ep for q in st]
    kv, lane, pre = h["engine"]

    def label(q: Req, n: int) -> str:
        when = f"(cut {q.done - r.rel:+.2f})" if q.cut else ""
        return f"{q.id.split('@')[0]}{n}{when}"

    return {
        "at": round(r.at, 2),
        "server": r.ep,
        "x": round(h["ttft"] / run.base, 2),
        "picker": round(h.get("wait") or 0.0, 3),
        "kv": round(kv, 3),
        "lane": round(lane, 3),
        "prefill": round(pre, 3),
        "ahead": ",".join(label(q, n) for q, n in ahead.chunks) if ahead else "-",
        "waited": sum(1 for s in steps if r.adm - 1e-6 <= s.start < r.start - 1e-6),
        "steps": len(mine),
        "with_i": sum(n for s in mine for q, n in s.chunks if q.band and q is not r),
        "with_b": sum(n for s in mine for q, n in s.chunks if not q.band),
        "close": sum(
            1
            for q in run.reqs
            if q.band and q.ep == r.ep and q is not r and abs(q.rel - r.rel) <= CLOSE_S
        ),
        "other_idle": bool(others) and not any(s.start <= r.rel < s.end for s in others),
        "_steps": [s for s in steps if s.end > r.adm and s.start < r.first],
    }


def cut_in_step(run: Run) -> dict:
    """Steps holding a batch prompt cut during them: how many, the lane seconds left after
    the cut, and the interactive requests admitted there meanwhile."""
    n = lane = hit = 0.0
    for ep, steps in run.steps.items():
        for s in steps:
            cut = [q.done for q, _ in s.chunks if q.cut and s.start <= q.done < s.end]
            if not cut:
                continue
            n += 1
            lane += s.end - min(cut)
            hit += sum(1 for q in run.reqs if q.band and q.ep == ep and s.start < q.adm < s.end)
    return {"steps": int(n), "lane_s_after_cut": round(lane, 2), "interactive_admitted": int(hit)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--x", type=float, default=2.0, help="slow: TTFT over X x unloaded p99")
    ap.add_argument("--sim-speed", type=float, default=0.5, help="the run's --sim-speed")
    ap.add_argument("--steps", action="store_true", help="print each slow request's steps")
    args = ap.parse_args()
    for path in args.paths:
        with open(path) as f:
            base = next(json.loads(x)["unloaded_ttft_p99"] for x in f if '"unloaded_ttft_p99"' in x)
        for row, _ in runs(path):
            if not row.get("all_trace"):
                continue
            run = rebuild(row, base, args.sim_speed)
            lane_err = sorted(e[0] for e in run.errors)
            pre_err = sorted(e[1] for e in run.errors)
            mid, p90 = len(lane_err) // 2, int(len(lane_err) * 0.9)
            print(
                f"== {path} {run.name}: rebuild against the sim's timing of {len(lane_err)} "
                f"interactive requests: lane error median {lane_err[mid]:.3f} s, p90 "
                f"{lane_err[p90]:.3f}; prefill median {pre_err[mid]:.3f}, p90 {pre_err[p90]:.3f}"
            )
            print(f"   batch prompts cut in their own step: {cut_in_step(run)}")
            slow = [h for h in row["hi_trace"] if (h.get("ttft") or 0) > args.x * base]
            for h in sorted(slow, key=lambda h: h["at"]):
                e = explain(run, h)
                if e is None:
                    continue
                steps = e.pop("_steps")
                print("   " + " ".join(f"{k}={v}" for k, v in e.items()))
                if args.steps:
                    for s in steps:
                        print(f"      step {s.start:.3f}-{s.end:.3f} "
                              + " ".join(f"{q.id}:{n}" for q, n in s.chunks))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
