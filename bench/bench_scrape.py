"""Metrics scraping benchmark: parse time of a real vLLM scrape against a generic parser
(prometheus_client) in the same run, and the picker-side CPU per scrape of the whole loop
(aiohttp GET + parse + store) against real HTTP servers in another process.

    uv run python bench/bench_scrape.py [--repeat 2000] [--endpoints 16] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from extproc.core import Endpoint
from extproc.endpoints.exposition import parse_metrics
from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.scrape import MetricsScraper, ScrapeSettings
from extproc.endpoints.state import EndpointStates

FIXTURE = Path(__file__).parents[1] / "tests" / "fixtures" / "vllm-0.32-cpu" / "metrics.txt"


def _median_s(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_parse(repeat: int) -> None:
    data = FIXTURE.read_bytes()

    def ours() -> None:
        parse_metrics(data)

    def generic() -> None:
        # What a generic scraper must do with the same bytes before it can pick six values.
        for family in text_string_to_metric_families(data.decode()):
            for _ in family.samples:
                pass

    ours_s = _median_s(ours, repeat)
    generic_s = _median_s(generic, max(50, repeat // 20))
    lines = data.count(b"\n")
    print(f"## parse vLLM 0.32 /metrics ({len(data):,} bytes, {lines} lines), median")
    print(f"parse_metrics        {ours_s * 1e6:9.1f} us")
    print(f"prometheus_client    {generic_s * 1e6:9.1f} us")
    print(f"ratio generic/ours   {generic_s / ours_s:9.1f} x")


_SERVER = textwrap.dedent(
    """
    import asyncio, itertools, sys
    from aiohttp import web
    body = open(sys.argv[1], "rb").read()
    changing = sys.argv[3] == "1"
    count = itertools.count()
    line = b'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0'
    async def handle(request):
        if changing:  # a busy engine: a load figure moves between scrapes
            moved = line.replace(b"0.0", b"%d.0" % (next(count) % 7))
            return web.Response(body=body.replace(line, moved), content_type="text/plain")
        return web.Response(body=body, content_type="text/plain")
    async def main():
        app = web.Application()
        app.router.add_get("/metrics", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        ports = []
        for _ in range(int(sys.argv[2])):
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])
        print(",".join(map(str, ports)), flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())
    """
)


async def bench_loop(endpoints: int, seconds: float, interval_s: float, changing: bool) -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(FIXTURE), str(endpoints), "1" if changing else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        ports = server.stdout.readline().strip().split(",")
        pool = EndpointPool(Endpoint(f"127.0.0.1:{p}") for p in ports)
        scraper = MetricsScraper(pool, EndpointStates(), ScrapeSettings(interval_s=interval_s))
        task = asyncio.create_task(scraper.run())
        await asyncio.sleep(0.5)  # connections up
        scrapes0, cpu0, wall0 = scraper.stats.scrapes, time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        scrapes = scraper.stats.scrapes - scrapes0
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        server.kill()
        server.wait()
    kind = "changing" if changing else "unchanged"
    print(
        f"## scrape loop: {endpoints} endpoints every {interval_s * 1e3:.0f} ms, {wall:.1f} s, "
        f"{kind} bodies"
    )
    print(f"scrapes/s            {scrapes / wall:9.0f}  (failures {scraper.stats.failures})")
    print(f"picker CPU/scrape    {cpu / max(1, scrapes) * 1e6:9.0f} us")
    print(f"picker CPU share     {cpu / wall * 100:9.1f} % of one core")
    print(f"per endpoint         {cpu / wall / endpoints * 1e3:9.2f} ms CPU per second")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--endpoints", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--interval-ms", type=float, default=50.0)
    args = ap.parse_args()
    bench_parse(args.repeat)
    for changing in (False, True):
        asyncio.run(bench_loop(args.endpoints, args.seconds, args.interval_ms / 1e3, changing))


if __name__ == "__main__":
    main()
