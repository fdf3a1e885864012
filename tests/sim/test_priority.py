"""The simulator's `--scheduling-policy priority`, as vLLM's priority policy: a lower request
`priority` is served first (ties by arrival), in the admission queue (batch full) and among
admitted prefills that have not started; a prefill under way is not overtaken. FCFS (the
default) ignores `priority` and accepts any integer, as vLLM 0.32 does without the policy.

The engine is slowed to a crawl while the requests arrive, so every one is queued before
any prefill after the first can end; the order compared is the engine's schedule then."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from extproc.core import Prompt
from extproc.sim.engine import Engine, EngineSettings, Job
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import SimTokenizer
from tests.sim.conftest import StartSim

TEXT = "The router sends the prefix to the server today. " * 20
TIMING = TimingSettings(speed=5.0)  # ~250 tokens: 5 ms of prefill each


async def first_token_order(
    tokenizer: SimTokenizer, policy: str, max_num_seqs: int, jobs: list[tuple[str, int]]
) -> list[str]:
    """Names in the order the engine will prefill them, with every job arrived; the first
    is under way (its prefill started) before the others arrive. (The schedule, not the
    order tasks wake up in: a loaded machine may wake two of them late, in either order.)"""
    engine = Engine(
        EngineSettings(timing=TIMING, max_num_seqs=max_num_seqs, scheduling_policy=policy),  # type: ignore[arg-type]
        tokenizer,
    )
    names: dict[int, str] = {}
    served: list[str] = []

    async def run(name: str, priority: int) -> None:
        ids = tokenizer.prompt_tokens(Prompt(completion=f"{name}: {TEXT}"))
        job = Job(ids, 1, priority=priority)
        names[id(job)] = name
        async for _ in engine.generate(job):
            served.append(name)

    engine.relative_speed = 0.001  # nothing ends while the queue forms
    tasks = []
    for name, priority in jobs:
        tasks.append(asyncio.create_task(run(name, priority)))
        await asyncio.sleep(0)  # arrival order = list order
        await asyncio.sleep(0)
    order = [names[id(j)] for j in engine.prefill_order()]
    engine.relative_speed = 1.0
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert sorted(served) == sorted(order)  # all served
    return order


JOBS = [("first", 5), ("low1", 0), ("low2", 0), ("high", -10), ("mid", -1), ("low3", 0)]


@pytest.mark.parametrize("max_num_seqs", [1, 256])  # admission queue / prefill lane
async def test_priority_policy_serves_lower_values_first(tokenizer, max_num_seqs):
    order = await first_token_order(tokenizer, "priority", max_num_seqs, JOBS)
    assert order == ["first", "high", "mid", "low1", "low2", "low3"]


@pytest.mark.parametrize("max_num_seqs", [1, 256])
async def test_fcfs_ignores_priority(tokenizer, max_num_seqs):
    order = await first_token_order(tokenizer, "fcfs", max_num_seqs, JOBS)
    assert order == [name for name, _ in JOBS]


async def test_the_request_priority_reaches_the_engine(start_sim: StartSim):
    """From the body's `priority`, or vLLM's `x-vllm-priority` header (read first); a
    priority that is not an integer is refused (400), as vLLM refuses it."""
    async with (
        start_sim(events=False, scheduling_policy="priority") as srv,
        aiohttp.ClientSession() as http,
    ):
        seen: list[int] = []
        generate = srv.engine.generate

        def spy(job: Job):
            seen.append(job.priority)
            return generate(job)

        srv.engine.generate = spy  # type: ignore[method-assign]
        url = f"{srv.url}/v1/completions"
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
        for extra, headers in [
            ({}, {}),
            ({"priority": -3}, {}),
            ({"priority": 4}, {"x-vllm-priority": "-7"}),
            ({"priority": 2}, {"x-vllm-priority": "not a number"}),
        ]:
            async with http.post(url, json={**body, **extra}, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
        assert seen == [0, -3, -7, 2]
        async with http.post(url, json={**body, "priority": "high"}) as resp:
            assert resp.status == 400
