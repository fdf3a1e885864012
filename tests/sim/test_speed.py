"""Heterogeneous and changing server speeds, and the latency histograms a latency model
learns from (exported as vLLM exports them, read back with the picker's own parser)."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from extproc.endpoints.exposition import parse_metrics
from extproc.sim.cli import build_arg_parser, server_settings
from extproc.sim.timing import TimingSettings
from tests.sim.conftest import StartSim
from tests.sim.test_timing import TEXT, ttft

TIMING = TimingSettings(prefill_tps=2000.0, speed=10.0)  # ~600 uncached tokens: 30 ms wall


async def scrape(http: aiohttp.ClientSession, url: str):
    async with http.get(f"{url}/metrics") as resp:
        return parse_metrics(await resp.read())


async def test_a_slowed_server_prefills_slower_and_its_histograms_say_so(start_sim: StartSim):
    async with start_sim(events=False, timing=TIMING) as srv, aiohttp.ClientSession() as http:
        fast = await ttft(http, srv.url, TEXT + " one")
        before = (await scrape(http, srv.url)).latency
        async with http.post(f"{srv.url}/sim/speed", json={"relative_speed": 0.25}) as resp:
            assert resp.status == 200
            assert (await resp.json()) == {"relative_speed": 0.25}
        slow = await ttft(http, srv.url, "Another prompt. " + TEXT)  # nothing cached
        after = (await scrape(http, srv.url)).latency
    assert slow > fast  # wall clock: loose, the machine is shared; the histograms are exact
    assert before is not None and after is not None
    assert (before.prefill_count, after.prefill_count) == (1, 2)
    assert (before.ttft_count, after.ttft_count) == (1, 2)
    # Uncached tokens computed per request: two cold prompts of about the same length.
    assert before.prefill_tokens is not None and after.prefill_tokens is not None
    second = after.prefill_tokens - before.prefill_tokens
    assert before.prefill_tokens > 500 and 0.9 < second / before.prefill_tokens < 1.1
    slow_prefill = after.prefill_sum - before.prefill_sum
    # Prefill times are the engine's schedule (not wall-clock wake-ups): 4x, give or take
    # the fixed step overhead.
    assert slow_prefill / (after.prefill_tokens - before.prefill_tokens) > 3.5 * (
        before.prefill_sum / before.prefill_tokens
    )


async def test_speed_endpoint_refuses_bad_input(start_sim: StartSim):
    async with start_sim(events=False) as srv, aiohttp.ClientSession() as http:
        for body in (b"{}", b'{"relative_speed": 0}', b'{"relative_speed": "x"}', b"nope"):
            async with http.post(f"{srv.url}/sim/speed", data=body) as resp:
                assert resp.status == 400
        async with http.get(f"{srv.url}/sim/speed") as resp:
            assert (await resp.json()) == {"relative_speed": 1.0}


async def test_tpot_histogram_is_exported(start_sim: StartSim):
    async with start_sim(events=False) as srv, aiohttp.ClientSession() as http:
        await ttft(http, srv.url, "hello", max_tokens=5)
        got = (await scrape(http, srv.url)).latency
    assert got is not None and got.tpot_count == 1 and got.itl_count == 4


def test_cli_speeds_per_server() -> None:
    parse = build_arg_parser().parse_args
    got = server_settings(parse(["--servers", "3", "--speeds", "1,0.5,0.25"]))
    assert [s.engine.relative_speed for s in got] == [1.0, 0.5, 0.25]
    assert {s.engine.relative_speed for s in server_settings(parse(["--servers", "2"]))} == {1.0}
    for bad in ("1,2", "1,0,1", "1,-1,1"):
        try:
            server_settings(parse(["--servers", "3", "--speeds", bad]))
        except ValueError:
            continue
        raise AssertionError(f"--speeds {bad} accepted")


async def test_a_slowdown_stretches_the_prefills_already_admitted(start_sim: StartSim):
    """A tenant slowing the GPU slows the work it already holds: the prefill under way and
    the admitted ones queued behind it take longer, not only prefills admitted afterwards
    (otherwise a server with a queue hides its slowdown until that queue has drained)."""
    prefills, slower = await _slowed_while_admitted(start_sim, ("First", "Second"))
    assert prefills == 2
    # Fully stretched: ~4x; even if the first prefill ended before the change (a stalled
    # test loop), the second alone makes it 2.5x. Before the fix: exactly 1x.
    assert slower > 2.0


async def test_a_slowdown_stretches_every_admitted_prefill_not_only_the_newest(
    start_sim: StartSim,
):
    """Four prefills admitted back to back, then the server slows to a quarter: all four
    take longer. The lane once dropped every admitted prefill but the newest at admission
    (it pruned by the newcomer's start, in the future behind the queue), so only the newest
    was stretched and a queued server looked fast for the whole queue (the latency model's
    "lag" after a slowdown in bench/latency_slowdown_replay.py)."""
    prefills, slower = await _slowed_while_admitted(
        start_sim, ("First", "Second", "Third", "Fourth")
    )
    assert prefills == 4
    # All stretched: ~4x; if the first ended before the change (a stalled loop), still
    # (1 + 3 * 4) / 4 = 3.25x. With the newest alone stretched: at most (3 + 4) / 4 = 1.75x.
    assert slower > 2.5


async def _slowed_while_admitted(start_sim: StartSim, names: tuple[str, ...]) -> tuple[int, float]:
    """Prefills of one prompt per name, admitted back to back, then the server slowed to a
    quarter: (prefills the engine counted, their seconds per token / the full-speed ones)."""
    timing = TimingSettings(prefill_tps=2000.0, speed=2.0)  # ~600 uncached tokens: 150 ms
    async with start_sim(events=False, timing=timing) as srv, aiohttp.ClientSession() as http:
        await ttft(http, srv.url, TEXT + " zero")
        before = (await scrape(http, srv.url)).latency
        sent = asyncio.gather(*(ttft(http, srv.url, f"{n}. {TEXT}") for n in names))
        for _ in range(2000):  # until all are admitted (a few ms; bounded)
            g = srv.engine.gauges()
            if g.running + g.waiting >= len(names):
                break
            await asyncio.sleep(0.001)
        srv.engine.relative_speed = 0.25
        await sent
        after = (await scrape(http, srv.url)).latency
    assert before is not None and after is not None and before.prefill_tokens
    fast = before.prefill_sum / before.prefill_tokens  # seconds per token at full speed
    tokens = (after.prefill_tokens or 0.0) - before.prefill_tokens
    return after.prefill_count - before.prefill_count, (
        (after.prefill_sum - before.prefill_sum) / tokens / fast
    )


async def _steps(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/sim/steps") as resp:
        assert resp.status == 200
        return await resp.json()


async def test_the_lane_clock_shows_a_starved_engine_slower_than_its_histograms(
    start_sim: StartSim,
):
    """`/sim/steps`: the steps' scheduled seconds match the prefill histogram (the speed a
    picker learns), their wall seconds show the event loop starved past a step's end."""
    timing = TimingSettings(prefill_tps=2000.0, speed=2.0)  # ~600 tokens: ~150 ms wall
    async with start_sim(events=False, timing=timing) as srv, aiohttp.ClientSession() as http:
        assert await _steps(http, srv.url) == {
            "steps": 0, "tokens": 0, "scheduled_s": 0.0, "wall_s": 0.0,
        }  # fmt: skip
        await ttft(http, srv.url, TEXT + " calm")
        calm = await _steps(http, srv.url)
        hist = (await scrape(http, srv.url)).latency
        assert hist is not None and hist.prefill_tokens is not None

        async def starve() -> None:
            await asyncio.sleep(0.03)  # the step is under way
            time.sleep(0.4)  # the whole loop blocked past the step's scheduled end

        blocker = asyncio.create_task(starve())
        await ttft(http, srv.url, "Something else entirely. " + TEXT)
        await blocker
        starved = await _steps(http, srv.url)
        after = (await scrape(http, srv.url)).latency
    assert after is not None and after.prefill_tokens is not None
    assert calm["steps"] >= 1 and calm["tokens"] == hist.prefill_tokens
    assert abs(calm["scheduled_s"] - hist.prefill_sum) < 0.01
    assert calm["wall_s"] >= calm["scheduled_s"]
    scheduled = starved["scheduled_s"] - calm["scheduled_s"]
    wall = starved["wall_s"] - calm["wall_s"]
    # The histogram charges the schedule (~150 ms), the lane took the blocked 400 ms and more.
    assert abs(scheduled - (after.prefill_sum - hist.prefill_sum)) < 0.01
    assert 0.1 < scheduled < 0.3 and wall > 0.4 and wall > 1.5 * scheduled


async def test_a_restart_empties_the_cache_and_moves_the_process_start_time(
    start_sim: StartSim,
):
    """`POST /sim/restart`: what a scraper reads as a restart of this one server."""
    async with start_sim(events=False, timing=TIMING) as srv, aiohttp.ClientSession() as http:
        await ttft(http, srv.url, TEXT)
        before = await scrape(http, srv.url)
        async with http.post(f"{srv.url}/sim/restart") as resp:
            assert resp.status == 200
        after = await scrape(http, srv.url)
        async with http.get(f"{srv.url}/sim/cache") as resp:
            blocks = (await resp.json())["blocks"]
    assert before.process_start_s is not None and after.process_start_s is not None
    assert after.process_start_s > before.process_start_s
    assert blocks == []
