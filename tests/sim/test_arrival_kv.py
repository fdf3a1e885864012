"""The engine's KV as a request finds it on arrival (engine.ArrivalKV): what a benchmark sets
against the picker's books for that server (bench/trace_kvwait.py)."""

from __future__ import annotations

import asyncio

from extproc.core import Prompt
from extproc.sim.engine import Chunk, Engine, EngineSettings, Job
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import SimTokenizer

TEXT = "The router sends the prefix to the server today. " * 8


async def test_arrival_reports_free_held_and_the_queue_ahead(tokenizer: SimTokenizer):
    # 16 usable blocks of 16 tokens; each job holds prompt + max_tokens from admission.
    engine = Engine(EngineSettings(num_gpu_blocks=17, timing=TimingSettings(speed=20.0)), tokenizer)
    firsts: dict[str, Chunk] = {}

    async def run(name: str, max_tokens: int) -> None:
        text = "hi" if name == "small" else TEXT
        ids = tokenizer.prompt_tokens(Prompt(completion=f"{name}: {text}"))
        async for chunk in engine.generate(Job(ids, max_tokens)):
            firsts.setdefault(name, chunk)

    engine.relative_speed = 0.001  # nothing ends while the queue forms
    names = [("big", 40), ("blocked", 40), ("small", 2)]
    tasks = []
    for name, out in names:
        tasks.append(asyncio.create_task(run(name, out)))
        for _ in range(2):
            await asyncio.sleep(0)
    engine.relative_speed = 1.0
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    big, blocked, small = (firsts[n].arrival for n, _ in names)
    assert big is not None and blocked is not None and small is not None
    assert (big.free, big.held, big.ahead, big.ahead_need) == (16, 0, 0, 0)
    need = big.need
    assert need == engine.cache.blocks_for(len(tokenizer.prompt_tokens(
        Prompt(completion=f"big: {TEXT}")).ids) + 40 - 1)  # fmt: skip
    # `blocked` does not fit beside `big`: it waits at the queue's head ...
    assert blocked.free == 16 - need and blocked.held == need and blocked.ahead == 0
    assert blocked.need > blocked.free
    # ... and `small` would fit, but arrives behind it (FCFS): one ahead, its blocks told.
    assert small.need <= small.free and small.ahead == 1 and small.ahead_need == blocked.need
