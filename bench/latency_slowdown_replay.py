"""Diagnostic (not a benchmark): one in-process simulated server, the latency model fed by
its real /metrics every 50 ms, a Poisson stream of requests placed on it (each one's
prediction taken before placing it), and the server slowed to 0.3 after request 30.
Prints, per finished request, predicted vs measured TTFT and the model's state (fitted
per-request cost and tokens/s, our unfinished placements, late heads, rescales), to watch
how the model follows a slowdown on a server with a queue.

    .venv/bin/python bench/latency_slowdown_replay.py [requests] [mean gap s] [no-late-heads]
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import aiohttp

from extproc.core import EndpointState
from extproc.endpoints.exposition import Scraped, parse_metrics
from extproc.latency import LatencyModel
from extproc.latency.model import ModelSettings
from extproc.sim.engine import EngineSettings
from extproc.sim.server import ServerSettings, SimServer
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import SimTokenizer

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]
ADDR = "s0"


async def main(requests: int, gap_s: float, late_heads: bool) -> None:
    timing = TimingSettings(prefill_tps=5000.0, speed=1.0)
    settings = ServerSettings(
        engine=EngineSettings(timing=timing, num_gpu_blocks=3000), kv_events=None
    )
    model = LatencyModel(ModelSettings(late_heads=late_heads))
    rng = random.Random(1)
    last: Scraped | None = None
    stop = False
    async with SimServer(settings, SimTokenizer()) as srv, aiohttp.ClientSession() as http:

        async def scrape() -> None:
            nonlocal last
            while not stop:
                async with http.get(f"{srv.url}/metrics") as r:
                    last = parse_metrics(await r.read())
                model.learn(ADDR, last.latency, last.running, last.waiting)
                await asyncio.sleep(0.05)

        async def one(i: int, words: int, sent: float, pred: float, seen: str) -> None:
            prompt = " ".join(rng.choice(WORDS) for _ in range(words)) + f" {i}"
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "stream": True}
            async with http.post(f"{srv.url}/v1/completions", json=body) as resp:
                await resp.content.readline()
                ttft = time.monotonic() - sent
                await resp.read()
            print(
                f"{i:3d} sent {sent - t0:6.2f} predicted {pred:6.2f} measured {ttft:6.2f} "
                f"off {(pred - ttft) / ttft:+5.0%} | at placement: {seen}",
                flush=True,
            )

        def seen_now(now: float) -> str:
            """What the model knew when it priced a request: its fit, our queue there, the
            head's time running (from its latest possible start) against its price."""
            c, s = model.coefficients(ADDR), model.stats
            b = model.backlogs().get(ADDR)
            fit = "-" if c is None else f"{c.per_request_s * 1e3:.0f} ms + {c.tokens_per_s:.0f} t/s"
            head = "-"
            if c is not None and b is not None and len(b) and hasattr(b, "head_elapsed_s"):
                price = c.prefill_s(b.head_tokens * model.token_scale)
                head = f"{b.head_elapsed_s():.2f}/{price:.2f} s"
            return (
                f"fit {fit} queue {0 if b is None else len(b)} head ran/price {head} "
                f"late {s.late_heads} rescaled {s.rescaled_speed} reopened {s.reopened}"
            )

        t0 = time.monotonic()
        scraper = asyncio.create_task(scrape())
        tasks = []
        for i in range(requests):
            words = rng.choice([350, 350, 350, 1500])
            now = model.now()
            state = EndpointState(
                waiting=last.waiting if last else 0,
                running=last.running if last else 0,
                is_stale=last is None,
                age_s=0.0,
            )
            seen = seen_now(now)
            p = model.predict(ADDR, state, float(words), now)
            model.place(ADDR, float(words), now, float(words))
            tasks.append(
                asyncio.create_task(one(i, words, time.monotonic(), p.ttft_s if p else -1, seen))
            )
            if i == requests // 2:
                srv.engine.relative_speed = 0.3
                print(f"---- slowed to 0.3 at {time.monotonic() - t0:.2f} s after {i}", flush=True)
            await asyncio.sleep(rng.expovariate(1 / gap_s))
        await asyncio.gather(*tasks)
        stop = True
        await scraper


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    gap = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
    asyncio.run(main(n, gap, late_heads=sys.argv[3:4] != ["no-late-heads"]))
