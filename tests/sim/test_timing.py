"""The physics routing depends on: uncached prompt tokens and queueing cost TTFT.

Margins are wide (tens of milliseconds of simulated work against a few of overhead)."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from extproc.sim.timing import TimingSettings
from tests.sim.conftest import StartSim

TEXT = "The router sends the prefix to the server today. The cache stores many blocks. " * 30


async def ttft(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 1) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        await resp.content.readline()
        first = time.perf_counter() - start
        await resp.read()
    return first


async def test_ttft_grows_with_uncached_tokens(start_sim: StartSim):
    timing = TimingSettings(prefill_tps=2000.0, speed=4.0)  # ~600 tokens: 75 ms wall
    async with start_sim(events=False, timing=timing) as srv, aiohttp.ClientSession() as http:
        cold = await ttft(http, srv.url, TEXT)
        # A loaded machine only adds time: the fastest of a few cached answers is the
        # overhead a cold prefill adds its ~75 ms to (one warm read came 22 ms, in CI).
        warm = min([await ttft(http, srv.url, TEXT) for _ in range(3)])
    assert cold > warm + 0.05


async def test_ttft_grows_with_queueing_behind_a_full_batch(start_sim: StartSim):
    timing = TimingSettings(decode_tps=100.0, speed=10.0)  # 300 tokens: 300 ms wall
    async with (
        start_sim(events=False, timing=timing, max_num_seqs=1) as srv,
        aiohttp.ClientSession() as http,
    ):
        # The fastest of a few: a loaded machine only adds time (one read 97 ms, in CI).
        alone = min([await ttft(http, srv.url, f"hello {i}") for i in range(3)])
        first = asyncio.create_task(ttft(http, srv.url, "busy", max_tokens=300))
        async with asyncio.timeout(5):  # it reaches the engine (later on a loaded machine)
            while srv.engine.gauges().running != 1:
                await asyncio.sleep(0.005)
        queued = await ttft(http, srv.url, "hello again")
        assert srv.engine.gauges().waiting == 0
        await first
    assert queued > alone + 0.15  # it waited out most of the busy answer's 300 ms
