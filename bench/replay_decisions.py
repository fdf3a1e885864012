"""Replays the routing decisions of `bench/trace_routing.py` runs straight to simulated
servers, no Envoy and no picker, to tell placement quality from machine load.

    uv run python bench/replay_decisions.py --workload tenants --load 24 --seed 1 \\
        --rounds 2 trace/tenants-redis1-0.jsonl trace/tenants-redis3-0.jsonl

A 1-replica and a 3-replica run differ in two ways: where they sent each request (their
decisions) and what else ran on the machine meanwhile (three pickers and Redis next to the
simulators, Envoy and the load generator). Replaying each trace's (send time, body, chosen
server) to a fresh simulator fleet with the bench's flags keeps the decisions and drops the
rest, so the replays of both traces run on the same machine load; traces are replayed
interleaved (A, B, A, B). Open-loop workloads (tenants) keep each request's recorded send
time; closed-loop ones (agentic) keep each session's turn order, start stagger and think time
(a turn is sent when the previous one ended, as in the original). Servers are matched by the
sorted order of the names the trace saw (the simulated servers are identical, only the
partition of requests among them matters). Requests that failed in the trace are not sent.

Per replay: TTFT p50/p90/p99, the hit ratio from the requests' usage and from the simulators'
own prefix-cache counters, the spread, and the CPU seconds the simulators and the load
generator took; beside it the original run's figures from its trace (and its `.cpu.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import httpx
from bench_routing import AGENTIC, PRESSURE_SHAPE, stretched, tenants_spec
from trace_causes import cause_of_each
from trace_routing import _send, cpu_seconds, lane_clock, lane_delta, lane_line

from extproc.sim.sessions import build_sessions
from extproc.sim.workload import WorkItem, build_workload
from extproc.stack import SimFleet

# (server URL, item, t0) -> the row `trace_routing._send` writes.
Sender = Callable[[str, WorkItem, float], Awaitable[dict]]


@dataclass(frozen=True, slots=True)
class Send:
    """One request to replay: its item, the fleet server it goes to, and (open loop) when."""

    item: WorkItem
    target: int
    at_s: float = 0.0


def endpoint_map(rows: Sequence[dict], servers: int) -> dict[str, int]:
    """Each server name the trace saw -> a fleet server number, in sorted name order."""
    names = sorted({r["served_by"] for r in rows if r.get("served_by")})
    if len(names) > servers:
        raise ValueError(f"trace used {len(names)} servers, the fleet has {servers}")
    return {n: k for k, n in enumerate(names)}


def _targets(rows: Sequence[dict], servers: int) -> dict[int, tuple[int, float]]:
    where = endpoint_map(rows, servers)
    return {
        r["index"]: (where[r["served_by"]], r["sent_s"])
        for r in rows
        if r.get("served_by") and r.get("status") == 200
    }


def open_loop_plan(rows: Sequence[dict], items: Sequence[WorkItem], servers: int) -> list[Send]:
    """The trace's requests at their recorded send times, to the servers they went to."""
    targets = _targets(rows, servers)
    plan = [Send(i, *targets[i.index]) for i in items if i.index in targets]
    return sorted(plan, key=lambda s: s.at_s)


def closed_loop_plan(
    rows: Sequence[dict], sessions: Sequence[Sequence[WorkItem]], servers: int
) -> list[list[Send]]:
    """Each session's turns in order, to the servers they went to (send times follow the
    replay's own latencies, as the original's followed its)."""
    targets = _targets(rows, servers)
    return [
        [Send(i, targets[i.index][0]) for i in session if i.index in targets]
        for session in sessions
    ]


async def replay_open(plan: Sequence[Send], urls: Sequence[str], send: Sender) -> list[dict]:
    t0 = time.perf_counter()

    async def at(s: Send) -> dict:
        await asyncio.sleep(max(0.0, t0 + s.at_s - time.perf_counter()))
        return await send(urls[s.target], s.item, t0)

    return list(await asyncio.gather(*(at(s) for s in plan)))


async def replay_closed(
    plan: Sequence[Sequence[Send]], urls: Sequence[str], send: Sender,
    stagger_s: float, think_s: float,
) -> list[dict]:  # fmt: skip
    t0 = time.perf_counter()

    async def session(k: int, sends: Sequence[Send]) -> list[dict]:
        await asyncio.sleep(k * stagger_s)
        out = []
        for s in sends:
            out.append(await send(urls[s.target], s.item, t0))
            await asyncio.sleep(think_s)
        return out

    per = await asyncio.gather(*(session(k, s) for k, s in enumerate(plan)))
    return [r for rs in per for r in rs]


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def figures(rows: Sequence[dict]) -> dict:
    """TTFT percentiles, usage hit ratio, spread and the engine/outside split of some rows."""
    ok = [r for r in rows if r.get("status") == 200 and "ttft_s" in r]
    ttft = sorted(r["ttft_s"] for r in ok)
    engine = sorted(r["engine_s"] for r in ok if "engine_s" in r)
    outside = sorted(r["ttft_s"] - r["engine_s"] for r in ok if "engine_s" in r)
    spread: dict[str, int] = {}
    for r in ok:
        spread[r["served_by"]] = spread.get(r["served_by"], 0) + 1
    prompt = sum(r.get("prompt_tokens", 0) for r in ok)
    return {
        "ok": len(ok), "sent": len(rows),
        "p50": _pct(ttft, 0.5), "p90": _pct(ttft, 0.9), "p99": _pct(ttft, 0.99),
        "hit": sum(r.get("cached_tokens", 0) for r in ok) / max(prompt, 1),
        "engine_p50": _pct(engine, 0.5), "outside_p50": _pct(outside, 0.5),
        "spread": "/".join(str(n) for n in sorted(spread.values(), reverse=True)),
    }  # fmt: skip


def _line(name: str, f: dict, extra: str = "") -> str:
    return (
        f"{name:<44} ok {f['ok']}/{f['sent']} TTFT p50 {f['p50']:.3f} p90 {f['p90']:.3f} "
        f"p99 {f['p99']:.3f} hit {f['hit']:.1%} (engine p50 {f['engine_p50']:.3f}, outside "
        f"{f['outside_p50']:.3f}) spread {f['spread']}{extra}"
    )


def prefix_counters(urls: Sequence[str]) -> tuple[float, float]:
    """The fleet's prefix-cache hit and query tokens so far, from the servers' /metrics."""
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("vllm:prefix_cache_hits"):
                hits += float(value)
            elif name.startswith("vllm:prefix_cache_queries"):
                queries += float(value)
    return hits, queries


def by_cause(rows: Sequence[dict], cause: dict[int, str]) -> tuple[dict, dict]:
    """Uncached prompt tokens (the prefill work a decision left) and requests at or above
    the rows' TTFT p90, per miss cause of `trace_causes.py` (causes from the original trace)."""
    ok = [r for r in rows if r.get("status") == 200 and "ttft_s" in r and r["index"] in cause]
    p90 = _pct(sorted(r["ttft_s"] for r in ok), 0.9)
    work: dict[str, int] = {}
    slow: dict[str, int] = {}
    for r in ok:
        c = cause[r["index"]].split(" (")[0]
        work[c] = work.get(c, 0) + r.get("prompt_tokens", 0) - r.get("cached_tokens", 0)
        slow[c] = slow.get(c, 0) + (r["ttft_s"] >= p90)
    return work, slow


def replay(
    workload: str, load: float, seed: int, rows: list[dict], log_dir: Path,
    time_scale: float = 1.0,
) -> tuple[dict, list[dict]]:  # fmt: skip
    """`time_scale`: the trace's (`trace_routing.py --time-scale`): the simulators run x T
    as fast; a tenants trace's send times are already in its wall seconds, an agentic
    session's stagger and think times are divided by T as the trace's were."""
    servers, sim_args = PRESSURE_SHAPE[workload]
    sim_args = stretched(sim_args, time_scale)
    with SimFleet(servers, sim_args, log_dir=log_dir) as fleet:
        urls = [s.url for s in fleet.servers]
        h0, q0 = prefix_counters(urls)
        lanes0 = lane_clock(urls)
        cpu0 = cpu_seconds()

        async def run() -> list[dict]:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

                def send(url: str, item: WorkItem, t0: float) -> Awaitable[dict]:
                    return _send(http, url, item, t0)

                if workload == "agentic":
                    sessions = build_sessions(replace(AGENTIC, sessions=int(load), seed=seed))
                    plan = closed_loop_plan(rows, sessions, servers)
                    return await replay_closed(
                        plan, urls, send, AGENTIC.stagger_s / time_scale,
                        AGENTIC.think_s / time_scale,
                    )  # fmt: skip
                items = build_workload(tenants_spec(seed))
                return await replay_open(open_loop_plan(rows, items, servers), urls, send)

        wall0 = time.perf_counter()
        out = asyncio.run(run())
        wall = time.perf_counter() - wall0
        cpu1 = cpu_seconds()
        h1, q1 = prefix_counters(urls)
        lanes = lane_delta(lanes0, lane_clock(urls))
    f = figures(out)
    f["metrics_hit"] = (h1 - h0) / max(q1 - q0, 1.0)
    f["wall_s"] = round(wall, 2)
    f["cpu_s"] = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu1.items()}
    f["lanes"] = lanes
    return f, out


def _print_causes(rows: Sequence[dict], cause: dict[int, str]) -> None:
    work, slow = by_cause(rows, cause)
    for c in sorted(work, key=lambda c: -work[c]):
        print(f"    {c:<52} uncached tokens {work[c]:7d}, at or above p90 {slow[c]:3d}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+", type=Path, help="trace_routing.py JSONL files")
    p.add_argument("--workload", choices=("agentic", "tenants"), required=True)
    p.add_argument("--load", type=float, help="sessions (agentic) or req/s (tenants)")
    p.add_argument("--seed", type=int, default=1, help="the traces' seed")
    p.add_argument("--rounds", type=int, default=2, help="traces interleaved, this many times")
    p.add_argument("--out", type=Path, help="write every replay's figures here as JSON lines")
    p.add_argument(
        "--rows", type=Path,
        help="write each replay's per-request rows here (<trace stem>-replay<round>.jsonl)",
    )  # fmt: skip
    p.add_argument(
        "--causes", action="store_true",
        help="tenants: uncached tokens and slow requests per miss cause (trace_causes.py)",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=1.0, metavar="T",
        help="the traces' trace_routing.py --time-scale (simulators x T as fast; TTFTs stay "
        "in wall seconds)",
    )  # fmt: skip
    args = p.parse_args(argv)
    load = args.load or (8 if args.workload == "agentic" else 24)
    traces = {t: [json.loads(x) for x in t.read_text().splitlines()] for t in args.traces}
    for t, rows in traces.items():
        cpu = t.with_suffix(".cpu.json")
        extra = ""
        if cpu.exists():
            c = json.loads(cpu.read_text())
            extra = f" | CPU s over {c['wall_s']:.1f} s: " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(c["cpu_s"].items())
            )
        print(_line(f"original {t.name}", figures(rows), extra), flush=True)
        if cpu.exists() and "lanes" in c:
            print(f"    {lane_line(c['lanes'])}", flush=True)
        if args.causes:
            _print_causes(rows, cause_of_each(rows))
    results = []
    with tempfile.TemporaryDirectory(prefix="replay-decisions-") as tmp:
        for rnd in range(args.rounds):
            for t, rows in traces.items():
                f, out = replay(args.workload, load, args.seed, rows, Path(tmp), args.time_scale)
                f |= {"trace": str(t), "round": rnd}
                results.append(f)
                cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(f["cpu_s"].items()))
                print(
                    _line(f"replay {rnd} {t.name}", f, f" metrics hit {f['metrics_hit']:.1%}")
                    + f" | CPU s over {f['wall_s']:.1f} s: {cpu}",
                    flush=True,
                )
                print(f"    {lane_line(f['lanes'])}", flush=True)
                if args.rows:
                    args.rows.mkdir(parents=True, exist_ok=True)
                    dest = args.rows / f"{t.stem}-replay{rnd}.jsonl"
                    dest.write_text("".join(json.dumps(r) + "\n" for r in out))
                if args.causes:
                    _print_causes(out, cause_of_each(rows))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
