"""Does the picker's CPU grow with output length? Streamed completions of 100 and of 10,000
tokens through Envoy and `extproc serve` to simulated vLLM servers, interleaved round by
round, against the picker's background CPU (scraping, health checks) measured idle in the
same run, idle and while engines stream replies sent to them directly (a busy engine's
metrics change every scrape, so scraping it costs more than an idle one).

Per request: gross CPU (the picker's on-CPU time over the round / requests) and net CPU
(gross minus the background rate times the round's wall time). The picker asks Envoy for no
response bodies, so net CPU should not depend on output length; the background rate is
reported per endpoint per second.

    uv run python bench/bench_output.py [--rounds 3] [--decode-tps 4000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_bodies import cpu_seconds

from extproc.stack import Stack, StackOptions


def stream_one(client: httpx.Client, url: str, model: str, tokens: int, n: int) -> None:
    body = {
        "model": model,
        "prompt": f"request {n}: tell me a long story",
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for _ in r.iter_raw():
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--endpoints", type=int, default=3)
    ap.add_argument("--decode-tps", type=float, default=4000.0)
    ap.add_argument("--idle-s", type=float, default=4.0)
    ap.add_argument("--config", help="picker config file (e.g. one with `state: {scrape: null}`)")
    args = ap.parse_args()
    sim = ("--decode-tps", str(args.decode_tps), "--max-model-len", "32768")
    extra = ("--config", args.config) if args.config else ()
    opts = StackOptions(upstreams=args.endpoints, sim_args=sim, extproc_args=extra)
    plan = {100: 40, 10_000: 2}  # requests per round of each length
    gross: dict[int, list[float]] = {t: [] for t in plan}
    net: dict[int, list[float]] = {t: [] for t in plan}
    net_busy: list[float] = []  # 10k-token requests net of the busy background
    idle: list[float] = []
    busy: list[float] = []
    n = 0
    with Stack(opts) as stack, httpx.Client(timeout=120) as client:
        pid = stack._procs["extproc"].pid
        model = stack.fleet.model
        stream_one(client, stack.url, model, 10, n)  # warm up
        for _ in range(args.rounds):
            c0, t0 = cpu_seconds(pid), time.perf_counter()
            time.sleep(args.idle_s)
            rate = (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
            idle.append(rate)
            # Busy background: the same 10k-token streams sent to the engines directly (not
            # through Envoy), so the picker does no request work while its scrapes see busy
            # engines whose metrics change every time.
            c0, t0 = cpu_seconds(pid), time.perf_counter()
            for i in range(plan[10_000]):
                n += 1
                upstream = stack.upstream_addresses[i % len(stack.upstream_addresses)]
                stream_one(client, f"http://{upstream}", model, 10_000, n)
            busy_wall = time.perf_counter() - t0
            busy.append((cpu_seconds(pid) - c0) / busy_wall)
            for tokens, count in plan.items():
                c0, t0 = cpu_seconds(pid), time.perf_counter()
                for _ in range(count):
                    n += 1
                    stream_one(client, stack.url, model, tokens, n)
                cpu, wall = cpu_seconds(pid) - c0, time.perf_counter() - t0
                gross[tokens].append(cpu / count * 1e3)
                net[tokens].append((cpu - rate * wall) / count * 1e3)
                if tokens == 10_000:
                    net_busy.append((cpu - busy[-1] * wall) / count * 1e3)
    bg = statistics.median(idle)
    print(
        f"background: {bg * 1e3:.1f} ms CPU/s for {args.endpoints} endpoints "
        f"({bg * 1e3 / args.endpoints:.1f} ms per endpoint per second); with one engine "
        f"busy: {statistics.median(busy) * 1e3:.1f} ms CPU/s "
        f"(rounds: {', '.join(f'{x * 1e3:.1f}' for x in busy)})"
    )
    print("| output tokens | gross CPU ms/req | net CPU ms/req (rounds) |")
    print("|---|---|---|")
    for tokens in plan:
        g, m = statistics.median(gross[tokens]), statistics.median(net[tokens])
        rounds = ", ".join(f"{x:.2f}" for x in net[tokens])
        print(f"| {tokens:,} | {g:.2f} | {m:.2f} ({rounds}) |")
    g = statistics.median(gross[10_000]) / statistics.median(gross[100])
    m = statistics.median(net[10_000]) / statistics.median(net[100])
    b = statistics.median(net_busy) / statistics.median(net[100])
    print(
        f"ratio 10k/100: gross {g:.2f}x, net of background {m:.2f}x, 10k net of the busy "
        f"background {b:.2f}x (10k net ms/req: {', '.join(f'{x:.2f}' for x in net_busy)})"
    )


if __name__ == "__main__":
    main()
