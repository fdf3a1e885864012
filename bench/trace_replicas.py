"""Issue 14 diagnosis: what each picker replica knows after an agentic run (prefill speeds,
token calibration, shared exchanges) and, per request, where it went and what was predicted.

    .venv/bin/python bench/trace_replicas.py --replicas 3     # 3 replicas sharing Redis
    .venv/bin/python bench/trace_replicas.py --replicas 1     # 1 replica on the same Redis
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx
from bench_routing import AGENTIC, PRESSURE_SHAPE, redis_server  # bench/ is on the path

from extproc.sim.sessions import build_sessions, run_closed_loop
from extproc.sim.workload import summarize
from extproc.stack import SimFleet, Stack, StackOptions

_KEEP = re.compile(
    r"^(extproc_prefill_tokens_per_second|extproc_approx_bytes_per_token|"
    r"extproc_approx_recalibrations|extproc_shared_\w+|extproc_decisions_total|"
    r"extproc_index_lookups\w*|extproc_index_\w*degraded\w*)"
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    servers, sim_args = PRESSURE_SHAPE["agentic"]
    with tempfile.TemporaryDirectory(prefix="trace-replicas-") as tmp, contextlib.ExitStack() as ex:
        log_dir = Path(tmp)
        fleet = ex.enter_context(SimFleet(servers, sim_args, log_dir=log_dir))
        url = ex.enter_context(redis_server(log_dir))
        stack = ex.enter_context(
            Stack(StackOptions(fleet=fleet, log_dir=log_dir, replicas=args.replicas, redis_url=url))
        )
        sessions = build_sessions(replace(AGENTIC, sessions=args.sessions, seed=args.seed))
        results, dur = asyncio.run(
            run_closed_loop(sessions, stack.url, think_s=AGENTIC.think_s,
                            stagger_s=AGENTIC.stagger_s)
        )  # fmt: skip
        s = summarize(results, dur)
        names = {a: f"s{i}" for i, a in enumerate(sorted(s.per_endpoint))}
        print(f"hit {s.hit_ratio:.1%} p50 {s.ttft_p50_s:.3f} p90 {s.ttft_p90_s:.3f} "
              f"spread {s.per_endpoint}")  # fmt: skip
        per_turn = len(sessions[0])
        for k, sess in enumerate(sessions):
            row = []
            for item in sess:
                r = results[item.index]
                pred = f"{r.predicted_ttft_s:.2f}" if r.predicted_ttft_s is not None else "-"
                hit = r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0
                ttft = r.ttft_s or 0
                row.append(f"{names.get(r.served_by, '?')}:{hit:.0%}:{ttft:.2f}/{pred}")
            print(f"session {k} ({per_turn} turns): " + " ".join(row))
        admins = [stack.picker_admin_port, *(a for _, _, a in stack.replica_ports)]
        for i, port in enumerate(admins):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            print(f"--- replica {i}")
            for line in text.splitlines():
                if _KEEP.match(line):
                    for a, n in names.items():
                        line = line.replace(a, n)
                    print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
