"""A bytes-per-token recalibration keeps what the approximate index learned, through
`extproc serve` behind Envoy with simulated vLLM servers: prompts placed before the change go
back to the server that holds them after it, and that server serves them from its cache.

Before the key geometry was pinned, the change moved every block boundary and every recorded
prefix stopped matching: the same follow-ups were placed like new prefixes."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import httpx

from extproc.sim.workload import WorkItem, send_one
from extproc.stack import Stack, StackOptions
from tests.e2e.calibration_workload import SIM, gauge, syllable_text

# The simulator's tokenizer averages ~1.3 characters per token: from 3, calibration finds 1
# (a ratio of ~2.3, inside its bounds and far outside its hysteresis).
PARSE = "parse: {bytes_per_token: 3}\n"
GROUPS = 6


def _item(index: int, system: str, question: str) -> WorkItem:
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
    }
    return WorkItem(index, 0, index, 0, 0, body)


async def _scenario(stack: Stack) -> tuple[list, list, dict[str, float | None]]:
    admin = f"http://127.0.0.1:{stack.picker_admin_port}/metrics"
    rng = random.Random(11)
    systems = [syllable_text(rng, 900) for _ in range(GROUPS)]
    async with aiohttp.ClientSession() as s, httpx.AsyncClient() as h:

        async def gauges() -> dict[str, float | None]:
            text = (await h.get(admin)).text
            return {
                k: gauge(text, f"extproc_approx_{k}")
                for k in ("block_tokens", "bytes_per_token", "recalibrations")
            }

        # The engines' block size arrives with the first scrapes (that change does re-key,
        # once, before traffic).
        deadline = time.monotonic() + 30
        while (await gauges())["block_tokens"] != 16:
            assert time.monotonic() < deadline, await gauges()
            await asyncio.sleep(0.1)
        # One at a time, so each placement is recorded before the next is decided.
        first = [
            await send_one(s, stack.url, _item(g, systems[g], "q one"), 30) for g in range(GROUPS)
        ]
        # Distinct filler until calibration has measured the engines' token counts and
        # changed bytes-per-token (two windows of >= 16k engine tokens, >= 8 requests).
        n = 100
        while (await gauges())["bytes_per_token"] == 3:
            assert n < 700, await gauges()
            batch = [_item(n + i, syllable_text(rng, 500), "filler") for i in range(6)]
            n += len(batch)
            done = await asyncio.gather(*(send_one(s, stack.url, b, 30) for b in batch))
            assert all(r.status == 200 for r in done), [r.error for r in done]
            await asyncio.sleep(0.2)  # a few scrapes between batches
        after = await gauges()
        again = [
            await send_one(s, stack.url, _item(GROUPS + g, systems[g], "q two"), 30)
            for g in range(GROUPS)
        ]
    return first, again, after


def test_a_recalibration_keeps_the_prefixes_placed_before_it(tmp_path):
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PARSE)
    opts = StackOptions(upstreams=3, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack:
        first, again, after = asyncio.run(_scenario(stack))
    assert all(r.status == 200 for r in first + again), [r.error for r in first + again]
    assert after["bytes_per_token"] is not None and after["bytes_per_token"] < 3, after
    # The first round spread the groups (new prefixes); the filler could not have put them
    # anywhere else in the servers' caches (nothing is evicted).
    assert len({r.served_by for r in first}) >= 2, [r.served_by for r in first]
    # After the change every group goes home and is served from cache.
    assert [r.served_by for r in again] == [r.served_by for r in first]
    for a, f in zip(again, first, strict=True):
        assert a.cached_tokens >= 0.8 * f.prompt_tokens, (a.cached_tokens, f.prompt_tokens)
