"""The refill credit on an engine that queues: `predicted` (each request's end from its
placement) against `started` (from its decode's start, as the scraped first-token count
shows it), fed as the flow controller feeds them, against one simulated vLLM server with a
small KV cache (issue 15, twenty-third session).

    .venv/bin/python bench/credit_queueing.py [--requests 24] [--gap-s 0.15] [--blocks 64]

Requests go straight to the sim (no picker: nothing else decides), each of a 300-word prompt
and 20-49 output tokens, one every `--gap-s`; the KV holds about two at a time, so the rest
queue in the engine. Every 50 ms the sim's /metrics is scraped into `EndpointStates` (as the
picker's scraper does) and both credits are read for the server with a 0.3 s horizon. After
the first 3 s (both per-token times measured), per scrape: was a credit given, and did less
than it end within the horizon after; per end: had a credit at least its size been given
within the horizon before it (the end seen coming).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

import aiohttp

from extproc.endpoints.exposition import parse_metrics
from extproc.endpoints.state import EndpointStates
from extproc.flowcontrol.refill import PredictedRefill, StartedRefill

HORIZON_S = 0.3
SCRAPE_S = 0.05
WARM_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(address: str, requests: int, gap_s: float) -> None:
    states = EndpointStates()
    started = StartedRefill(HORIZON_S, time.monotonic)
    placement = PredictedRefill(HORIZON_S, time.monotonic)
    t0 = time.monotonic()
    ends: list[tuple[float, int]] = []
    samples: list[tuple[float, int, int, int]] = []  # at, waiting, started, placement

    async def one(s: aiohttp.ClientSession, i: int, out: int) -> None:
        tokens = 400 + out
        for r in (started, placement):
            r.placed(i, address, tokens, out)
        body = {"model": "tiny", "prompt": "word " * 300, "max_tokens": out, "stream": True}
        async with s.post(f"http://{address}/v1/completions", json=body) as resp:
            async for _ in resp.content:
                pass
        for r in (started, placement):
            r.freed(address, tokens, i)
        ends.append((time.monotonic() - t0, tokens))

    async def scrape(s: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            async with s.get(f"http://{address}/metrics") as resp:
                states.update(address, parse_metrics(await resp.read()))
            st = states.state(address)
            started.observe(address, st)
            at = time.monotonic() - t0
            samples.append((at, st.waiting, started.credit(address), placement.credit(address)))
            await asyncio.sleep(SCRAPE_S)

    async with aiohttp.ClientSession() as s:
        stop = asyncio.Event()
        scraper = asyncio.create_task(scrape(s, stop))
        sent = []
        for i in range(requests):
            sent.append(asyncio.create_task(one(s, i, 20 + (i * 7) % 30)))
            await asyncio.sleep(gap_s)
        await asyncio.gather(*sent)
        stop.set()
        await scraper
    print(
        f"per output token: from the decode's start {started.decode_per_token_s():.4f} s, "
        f"from placement {placement.per_token_s():.4f} s; engine waiting up to "
        f"{max(x[1] for x in samples)}; started credits without a first-token count: "
        f"{started.unstarted}"
    )
    late = [x for x in samples if x[0] > WARM_S]
    late_ends = [(e, t) for e, t in ends if e > WARM_S]
    for name, col in (("started", 2), ("predicted (placement)", 3)):
        given = [x for x in late if x[col] > 0]
        short = over = 0
        for x in given:
            got = sum(t for e, t in ends if x[0] < e <= x[0] + HORIZON_S)
            short += got < x[col]
            over += max(0, x[col] - got)
        seen = sum(
            1 for e, t in late_ends if any(e - HORIZON_S <= x[0] < e and x[col] >= t for x in late)
        )
        print(
            f"{name}: credited at {len(given)} of {len(late)} scrapes after {WARM_S:g} s; less "
            f"than the credit ended within {HORIZON_S} s at {short}; credited beyond what "
            f"ended {over / max(1, len(given)):.0f} tokens per credit; ends seen coming "
            f"{seen} of {len(late_ends)}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--gap-s", type=float, default=0.15)
    ap.add_argument("--blocks", type=int, default=64, help="the sim's KV blocks (16 tokens)")
    args = ap.parse_args()
    port = free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "extproc.sim", "--servers", "1", "--base-port", str(port),
         "--decode-tps", "25", "--num-gpu-blocks", str(args.blocks)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert sim.stdout is not None
        line = sim.stdout.readline().decode()
        if "sim ready" not in line:
            raise SystemExit(f"the sim did not start: {line}")
        asyncio.run(run(f"127.0.0.1:{port}", args.requests, args.gap_s))
    finally:
        sim.terminate()
        sim.wait()


if __name__ == "__main__":
    main()
