"""Issue 14 diagnosis: what each picker replica knows after an agentic run (prefill speeds,
token calibration, shared exchanges) and, per request, where it went and what was predicted.

    .venv/bin/python bench/trace_replicas.py --replicas 3     # 3 replicas sharing Redis
    .venv/bin/python bench/trace_replicas.py --replicas 1     # 1 replica on the same Redis
    .venv/bin/python bench/trace_replicas.py --replicas 3 --shared-placements

`--views` samples every replica's predicted-TTFT view (prefill queue per server, written
tokens per server) every 0.25 s during the run and prints how far apart they are.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import subprocess
import sys
import tempfile
import threading
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
    p.add_argument("--shared-placements", action="store_true")
    p.add_argument("--views", action="store_true")
    args = p.parse_args()
    servers, sim_args = PRESSURE_SHAPE["agentic"]
    with tempfile.TemporaryDirectory(prefix="trace-replicas-") as tmp, contextlib.ExitStack() as ex:
        log_dir = Path(tmp)
        fleet = ex.enter_context(SimFleet(servers, sim_args, log_dir=log_dir))
        url = ex.enter_context(redis_server(log_dir))
        extra: tuple[str, ...] = ()
        if args.shared_placements:
            cfg = log_dir / "shared.yaml"
            cfg.write_text("state: {shared_placements: true}\n")
            extra = ("--config", str(cfg))
        stack = ex.enter_context(
            Stack(StackOptions(fleet=fleet, log_dir=log_dir, replicas=args.replicas,
                               redis_url=url, extproc_args=extra))
        )  # fmt: skip
        admins = [stack.picker_admin_port, *(a for _, _, a in stack.replica_ports)]
        samples: list[list[dict[str, tuple[float, float]]]] = []
        stop = threading.Event()
        poller = threading.Thread(target=_poll_views, args=(admins, samples, stop), daemon=True)
        if args.views:
            poller.start()
        sessions = build_sessions(replace(AGENTIC, sessions=args.sessions, seed=args.seed))
        results, dur = asyncio.run(
            run_closed_loop(sessions, stack.url, think_s=AGENTIC.think_s,
                            stagger_s=AGENTIC.stagger_s)
        )  # fmt: skip
        stop.set()
        if args.views:
            poller.join()
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
        if args.views:
            _print_views(samples, names)
        _print_redis_commands(url, len(results))
        for i, port in enumerate(admins):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            print(f"--- replica {i}")
            for line in text.splitlines():
                if _KEEP.match(line):
                    for a, n in names.items():
                        line = line.replace(a, n)
                    print("  " + line)
    return 0


def _print_redis_commands(url: str, requests: int) -> None:
    """Redis commands per request over the whole run (startup and shutdown included), by
    command: what each decision costs Redis and the replicas' background loops."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["redis-cli", "-p", port, "info", "commandstats"],
                         capture_output=True, text=True).stdout  # fmt: skip
    calls = {}
    for line in out.splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[8:].split(":", 1)
            fields = dict(kv.split("=") for kv in rest.split(","))
            calls[name] = (int(fields["calls"]), float(fields["usec"]))
    total = sum(n for n, _ in calls.values())
    usec = sum(u for _, u in calls.values())
    top = sorted(calls.items(), key=lambda x: -x[1][0])[:8]
    print(f"redis: {total} commands, {total / max(1, requests):.1f} per request, "
          f"{usec / 1e6:.2f} s of Redis CPU; "
          + ", ".join(f"{k} {n}" for k, (n, _) in top))  # fmt: skip


def _views(text: str) -> dict[str, tuple[float, float]]:
    """Scorer 0's (queue s, written tokens) per endpoint from one /metrics text."""
    q: dict[str, float] = {}
    w: dict[str, float] = {}
    for line in text.splitlines():
        for name, into in (("extproc_predicted_prefill_queue_seconds{", q),
                           ("extproc_predicted_written_tokens{", w)):  # fmt: skip
            if line.startswith(name) and 'scorer="0"' in line:
                label, value = line.rsplit(" ", 1)
                into[label.split('endpoint="')[1].split('"')[0]] = float(value)
    return {a: (q.get(a, 0.0), w.get(a, 0.0)) for a in q.keys() | w.keys()}


def _poll_views(admins, samples, stop: threading.Event) -> None:
    with httpx.Client(timeout=5) as http:
        while not stop.wait(0.25):
            try:
                samples.append(
                    [_views(http.get(f"http://127.0.0.1:{p}/metrics").text) for p in admins]
                )
            except httpx.HTTPError:
                continue


def _print_views(samples, names) -> None:
    """Per server: each replica's mean predicted queue over the samples where any replica saw
    one, the mean of the largest-smallest gap between replicas, and the final written tokens."""
    if not samples:
        print("views: no samples")
        return
    n = len(samples[0])
    for a, label in sorted(names.items(), key=lambda x: x[1]):
        rows = [[snap[i].get(a, (0.0, 0.0)) for i in range(n)] for snap in samples]
        busy = [r for r in rows if max(q for q, _ in r) > 0]
        means = [statistics.fmean(r[i][0] for r in busy) if busy else 0.0 for i in range(n)]
        gaps = [max(q for q, _ in r) - min(q for q, _ in r) for r in busy]
        gap = statistics.fmean(gaps) if gaps else 0.0
        written = " / ".join(f"{rows[-1][i][1]:.0f}" for i in range(n))
        queues = " / ".join(f"{m:.3f}" for m in means)
        print(f"view {label}: queue mean s per replica {queues} (gap {gap:.3f}, "
              f"{len(busy)} busy samples); written tokens {written}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
