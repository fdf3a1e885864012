"""`extproc serve --workers N` behind one real Envoy: does the picker's throughput scale?

Three set-ups, each a Stack (echo upstream, Envoy, the picker with TLS and the access log),
driven by `wrk` at one concurrency until the picker is the bottleneck:
- `1 worker`;
- `2 workers, shared port`: SO_REUSEPORT only (Envoy multiplexes a thread's streams on one
  HTTP/2 connection, so one worker gets them all);
- `2 workers, own ports`: `--worker-ports` + `extproc_workers=2` in Envoy's bootstrap, round
  robin over the workers' ports.
Rounds interleave the set-ups (A, B, C, A, B, C): medians of requests/s and of the picker
processes' CPU (user+system, all workers) per request.

    uv run python bench/bench_workers_envoy.py [--seconds 8] [--rounds 3] [--conns 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from bench_proxy import chat_body, cpu_seconds, require_wrk, run_wrk

from extproc.stack import Stack, StackOptions, wait_until

SETUPS = {
    "1 worker": {},
    "2 workers, shared port": {"extproc_args": ("--workers", "2")},
    "2 workers, own ports": {"workers": 2},
}


def picker_pids(stack: Stack) -> list[int]:
    top = psutil.Process(stack._procs["extproc"].pid)
    return [top.pid, *(c.pid for c in top.children(recursive=True))]


def run(name: str, body: Path, conns: int, seconds: int) -> tuple[float, float]:
    with Stack(StackOptions(upstreams=1, **SETUPS[name])) as stack:
        if name != "1 worker":
            wait_until(lambda: len(picker_pids(stack)) == 3, timeout_s=30, what="workers")
        if name.endswith("own ports"):
            wait_until(lambda: stack.picker_healthy_in_envoy() == 2, timeout_s=30, what="both")
        run_wrk(stack.url, body, conns, 2)  # warm-up (both workers ready, connections open)
        pids = picker_pids(stack)
        cpu0 = sum(cpu_seconds(p) for p in pids)
        res = run_wrk(stack.url, body, conns, seconds)
        cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        if res.non_2xx:
            print(f"  {name}: {res.non_2xx} non-2xx", flush=True)
        return res.rps, cpu / max(res.requests, 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", type=int, default=32)
    args = ap.parse_args()
    require_wrk()
    out: dict[str, list[tuple[float, float]]] = {n: [] for n in SETUPS}
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body.json"
        body.write_bytes(chat_body(1024))
        for r in range(args.rounds):
            for name in SETUPS:
                rps, cpu = run(name, body, args.conns, args.seconds)
                out[name].append((rps, cpu))
                print(f"round {r} {name:<24} {rps:7.0f} req/s  {cpu:.3f} ms CPU/req", flush=True)
    base = statistics.median(x[0] for x in out["1 worker"])
    print("\n| set-up | req/s (median) | vs 1 worker | picker CPU ms/req | rounds req/s |")
    print("|---|---|---|---|---|")
    for name, runs in out.items():
        rps = statistics.median(x[0] for x in runs)
        cpu = statistics.median(x[1] for x in runs)
        each = ", ".join(f"{x[0]:.0f}" for x in runs)
        print(f"| {name} | {rps:.0f} | {rps / base:.2f}x | {cpu:.3f} | {each} |")


if __name__ == "__main__":
    main()
