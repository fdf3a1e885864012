"""Prefill in engine steps, as vLLM 0.32's scheduler spends its token budget
(`max_num_batched_tokens`): decodes and prefills under way first, waiting requests take
what is left, long prompts are chunked, `long_prefill_token_threshold` caps one request's
share of a step. First the planner alone, then the engine's timing of it."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from extproc.sim.cli import build_arg_parser, server_settings
from extproc.sim.engine import Engine, EngineSettings, Job
from extproc.sim.steps import ChunkPolicy, Work, plan_step
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import PromptTokens, SimTokenizer


def plan(policy: ChunkPolicy, running, waiting, decoding=0, eligible=None):
    run = [Work(name, left) for name, left in running]
    wait = [Work(name, left) for name, left in waiting]
    total = eligible if eligible is not None else len(run) + len(wait) + decoding
    return [(w.item, w.left) for w in plan_step(policy, run, wait, decoding, total)]


def test_running_prefills_take_the_budget_before_waiting_ones():
    p = ChunkPolicy(max_num_batched_tokens=2048)
    # A prefill under way with more than a step left takes the whole step: a waiting
    # request, whatever its priority, gets nothing (vLLM never sets a running one aside).
    assert plan(p, [("long", 6000)], [("short", 100)]) == [("long", 2048)]
    # Its last chunk leaves room: the waiting one shares that step.
    assert plan(p, [("long", 1900)], [("short", 100), ("next", 500)]) == [
        ("long", 1900), ("short", 100), ("next", 48)
    ]  # fmt: skip


def test_each_decoding_sequence_takes_one_token_first():
    p = ChunkPolicy(max_num_batched_tokens=2048)
    assert plan(p, [], [("a", 3000)], decoding=48) == [("a", 2000)]
    assert plan(p, [("a", 10)], [("b", 10)], decoding=2048) == []


def test_without_chunking_a_prompt_waits_for_a_step_with_room_for_all_of_it():
    p = ChunkPolicy(max_num_batched_tokens=2048, enable_chunked_prefill=False)
    assert plan(p, [], [("a", 1500), ("b", 1000), ("c", 10)]) == [("a", 1500)]
    chunked = ChunkPolicy(max_num_batched_tokens=2048)
    assert plan(chunked, [], [("a", 1500), ("b", 1000)]) == [("a", 1500), ("b", 548)]


def test_the_long_prefill_threshold_caps_a_request_only_with_company():
    p = ChunkPolicy(max_num_batched_tokens=2048, long_prefill_token_threshold=256)
    assert plan(p, [("long", 6000)], []) == [("long", 2048)]  # alone: the whole budget
    assert plan(p, [("long", 6000)], [("short", 100), ("big", 3000)]) == [
        ("long", 256), ("short", 100), ("big", 256)
    ]  # fmt: skip


# --- the engine: a short request arriving while a long prefill is under way ---------------

TIMING = TimingSettings(prefill_tps=10000.0, step_overhead_s=0.002, speed=4.0)
LONG, SHORT = 8000, 100  # 4 steps of 2048 (~52 ms each at this speed); 1 step


def prompt(n: int, seed: int) -> PromptTokens:
    rng = random.Random(seed)
    return PromptTokens(tuple(rng.randrange(5, 460) for _ in range(n)))


async def long_then_short(
    tokenizer: SimTokenizer, **settings
) -> tuple[list[str], dict[str, tuple[float, float, float]]]:
    """The long prompt (priority 0), then, 10 ms into its first step, the short one
    (priority -10); the order their first tokens came in, and each one's TTFT parts."""
    engine = Engine(
        EngineSettings(timing=TIMING, scheduling_policy="priority", **settings), tokenizer
    )
    order: list[str] = []
    parts: dict[str, tuple[float, float, float]] = {}

    async def run(name: str, n: int, priority: int) -> None:
        async for chunk in engine.generate(Job(prompt(n, n), 1, priority=priority)):
            assert chunk.timing is not None
            order.append(name)
            parts[name] = chunk.timing

    try:
        long = asyncio.create_task(run("long", LONG, 0))
        await asyncio.sleep(0.01)
        assert engine.gauges().running == 1, "the long prefill is under way"
        await asyncio.wait_for(asyncio.gather(long, run("short", SHORT, -10)), 30)
    finally:
        await engine.aclose()
    return order, parts


async def test_by_default_a_high_priority_request_waits_for_the_running_prefill(tokenizer):
    order, parts = await long_then_short(tokenizer)
    # vLLM's defaults (2048 a step, no threshold): the long prompt's chunks take every
    # step until its last, which the short one shares.
    assert order == ["long", "short"]
    _, step_wait, prefill = parts["short"]
    assert step_wait > 0.1  # ~3 of the long prompt's 4 steps (~0.15 s)
    assert prefill < step_wait


async def test_the_long_prefill_threshold_lets_it_in_at_the_next_step(tokenizer):
    order, parts = await long_then_short(tokenizer, long_prefill_token_threshold=256)
    assert order == ["short", "long"]
    step_wait = parts["short"][1]
    # It went in at the next step (~42 ms), inside the long prefill (~0.15 s), which the
    # order above shows it finished before; bounded by the long prefill's own time, not a
    # wall-clock constant a stalled machine breaks (CI once saw 0.27 s).
    assert step_wait < parts["long"][2]
    # And the long prompt pays: 256 tokens a step while the short one is there.
    assert sum(parts["long"][1:]) > 0.2


async def test_without_chunking_the_prompt_is_one_step(tokenizer):
    order, parts = await long_then_short(
        tokenizer, enable_chunked_prefill=False, max_num_batched_tokens=8192
    )
    assert order == ["long", "short"]
    assert parts["long"][2] > 0.15  # the whole prompt in one step (~0.2 s)


async def test_a_long_prompt_pays_one_step_overhead_per_chunk(tokenizer):
    """With a large fixed cost per step, 8000 tokens in chunks of 2048 (4 steps) take about
    four times the overhead of one step of 8192."""
    timing = TimingSettings(prefill_tps=1e7, step_overhead_s=0.05, speed=1.0)

    async def prefill_s(budget: int) -> float:
        engine = Engine(EngineSettings(timing=timing, max_num_batched_tokens=budget), tokenizer)
        try:
            async for chunk in engine.generate(Job(prompt(LONG, 1), 1)):
                assert chunk.timing is not None
                return chunk.timing[2]
        finally:
            await engine.aclose()
        raise AssertionError("no token")

    chunked, whole = await prefill_s(2048), await prefill_s(8192)
    assert chunked > 0.19 and whole < 0.12, (chunked, whole)


def test_settings_refuse_what_vllm_refuses():
    with pytest.raises(ValueError, match="smaller than max_model_len"):
        EngineSettings(enable_chunked_prefill=False)  # 2048 < 8192
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineSettings(max_num_batched_tokens=64)  # 256 sequences
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineSettings(max_model_len=512, long_prefill_token_threshold=1024)
    # Decoded from a config, the same checks hold.
    with pytest.raises(msgspec.ValidationError, match="max_num_seqs"):
        msgspec.convert({"max_num_batched_tokens": 64}, EngineSettings)


def test_cli_flags_use_vllms_names_and_defaults():
    (s,) = server_settings(build_arg_parser().parse_args([]))
    assert (s.engine.max_num_batched_tokens, s.engine.enable_chunked_prefill) == (2048, True)
    assert s.engine.long_prefill_token_threshold == 0
    flags = "--max-num-batched-tokens 8192 --no-enable-chunked-prefill"
    args = build_arg_parser().parse_args([*flags.split(), "--long-prefill-token-threshold", "512"])
    (s,) = server_settings(args)
    assert s.engine.chunk_policy == ChunkPolicy(8192, False, 512)


async def test_a_failed_step_fails_the_waiting_requests_instead_of_hanging(
    tokenizer, monkeypatch, caplog
):
    import extproc.sim.engine as engine_module

    def broken(*args, **kwargs):
        raise ValueError("broken planner")

    monkeypatch.setattr(engine_module, "plan_step", broken)
    engine = Engine(EngineSettings(timing=TIMING), tokenizer)
    try:
        with pytest.raises(RuntimeError, match="broken planner"):
            async with asyncio.timeout(5):
                async for _ in engine.generate(Job(prompt(SHORT, 1), 1)):
                    pass
    finally:
        await engine.aclose()
    assert "prefill steps failed" in caplog.text
