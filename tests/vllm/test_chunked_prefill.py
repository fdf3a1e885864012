"""Chunked prefill against the real engine: a short high-priority request arriving while a
long prompt is being prefilled in chunks, on a vLLM of its own with a small step budget
(`--max-num-batched-tokens 16`: a 1,900-token prompt is ~119 steps, 0.4-1.5 s here), with
`--scheduling-policy priority`, and the simulator given the same settings and the same
arrivals.

- vLLM's default (`--long-prefill-token-threshold 0`): the prefill under way takes every
  step's budget until its last chunk; the short request, whatever its priority, gets its
  first token with the long one's (vLLM 0.32 `Scheduler.schedule`: running requests first).
- With a threshold (8 tokens), the long prompt's chunk is capped while another request
  waits, so the short one gets in at the next step and finishes long before it.

On a loaded machine the API server may take 0.1-0.3 s to hand a request to a busy engine, so
arrival times seen by the client say little; the engine's own figure does: how long the
short request sat in its queue (the growth of vLLM's `request_queue_time_seconds` sum over
the pair, less the long request's share, measured alone). The simulator gets the same
settings and arrivals (the short one 60 ms after the long): its order of first tokens and
the short request's queue wait (in steps) must tell the same story as the engine's.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from extproc.sim.engine import Engine, EngineSettings, Job
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import PromptTokens, SimTokenizer
from tests.vllm.fleet import MODEL_NAME, own_servers

BUDGET, SEQS, MAX_LEN = 16, 4, 2048
LONG, SHORT = 1900, 40
SEND_SHORT_AFTER_S = 0.06
QUEUE_SUM = "vllm:request_queue_time_seconds_sum"
ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class Pair:
    """One attempt: each one's first token (seconds from the long one's send) and how long
    the short one waited for its first step, in seconds."""

    long_done: float
    short_done: float
    short_queued: float

    @property
    def order(self) -> list[str]:
        return ["long", "short"] if self.long_done <= self.short_done else ["short", "long"]


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 460) for _ in range(n)]


def first_token(url: str, prompt: list[int], priority: int) -> float:
    """Sends a one-token completion; returns when its first token arrived (monotonic)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "stream": True,
            "priority": priority}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.monotonic()
    raise AssertionError("no token")


def queued_seconds(url: str) -> float:
    """Seconds the engine's requests have waited for their first step, all added up."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    sums = [line for line in text.splitlines() if line.startswith(QUEUE_SUM)]
    return sum(float(line.rpartition(" ")[2]) for line in sums)


def timed_alone(url: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, queue wait) of one request on an idle engine."""
    before = queued_seconds(url)
    t0 = time.monotonic()
    ttft = first_token(url, prompt, 0) - t0
    time.sleep(0.1)  # the engine's stats follow its outputs
    return ttft, queued_seconds(url) - before


def real_pair(url: str, seed: int, long_queued: float) -> Pair:
    """The long request, then the short one `SEND_SHORT_AFTER_S` later."""
    before = queued_seconds(url)
    t0 = time.monotonic()
    done: dict[str, float] = {}
    long = threading.Thread(
        target=lambda: done.__setitem__("long", first_token(url, ids(LONG, seed), 0))
    )
    long.start()
    time.sleep(SEND_SHORT_AFTER_S)
    short_done = first_token(url, ids(SHORT, seed + 1), -10) - t0
    long.join()
    time.sleep(0.1)
    return Pair(done["long"] - t0, short_done, queued_seconds(url) - before - long_queued)


THRESHOLDS = (0, 8)


def engine_flags(threshold: int) -> tuple[str, ...]:
    return (
        *("--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", str(BUDGET)),
        *("--max-num-seqs", str(SEQS), "--long-prefill-token-threshold", str(threshold)),
        *("--scheduling-policy", "priority", "--num-gpu-blocks-override", "400"),
    )


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[int, str]]:
    """Each threshold's one-server vLLM with a 16-token step budget (url by threshold),
    started side by side."""
    with own_servers("extproc-vllm-chunked-", *map(engine_flags, THRESHOLDS)) as servers:
        yield {t: srv.url for t, srv in zip(THRESHOLDS, servers, strict=True)}


@pytest.fixture(scope="module", params=THRESHOLDS, ids=lambda t: f"threshold{t}")
def chunking_engine(request, engines: dict[int, str]) -> tuple[int, str, float, float]:
    """(threshold, url, seconds per step, an idle engine's queue wait)."""
    threshold = request.param
    url = engines[threshold]
    first_token(url, ids(SHORT, 1), 0)  # the first request warms the engine up
    alone = [timed_alone(url, ids(LONG, seed)) for seed in (11, 12, 13)]  # none cached
    step_s = statistics.median(t for t, _ in alone) / math.ceil(LONG / BUDGET)
    return threshold, url, step_s, statistics.median(q for _, q in alone)


async def sim_pair(threshold: int, step_s: float, offset: float, seed: int) -> Pair:
    """The same arrivals into the simulator, its steps costing what the engine's did."""
    timing = TimingSettings(prefill_tps=1e9, step_overhead_s=step_s)
    settings = EngineSettings(
        max_num_seqs=SEQS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=BUDGET,
        long_prefill_token_threshold=threshold,
        scheduling_policy="priority",
        num_gpu_blocks=400,
        block_size=32,
        timing=timing,
    )
    engine = Engine(settings, SimTokenizer())
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    done: dict[str, float] = {}
    queued: dict[str, float] = {}

    async def run(name: str, prompt: list[int], priority: int) -> None:
        async for chunk in engine.generate(Job(PromptTokens(tuple(prompt)), 1, priority=priority)):
            done[name] = loop.time() - t0
            assert chunk.timing is not None
            queued[name] = chunk.timing[0] + chunk.timing[1]

    try:
        long = asyncio.create_task(run("long", ids(LONG, seed), 0))
        await asyncio.sleep(offset)
        await asyncio.gather(long, run("short", ids(SHORT, seed + 1), -10))
    finally:
        await engine.aclose()
    return Pair(done["long"], done["short"], queued["short"])


def test_a_short_request_during_a_chunked_prefill(chunking_engine, capsys):
    threshold, url, step_s, long_queued = chunking_engine
    waits = threshold == 0  # vLLM's default: behind the whole prefill under way
    expected = ["short", "long"]  # with a threshold
    sim = asyncio.run(sim_pair(threshold, step_s, SEND_SHORT_AFTER_S, 1))
    reals = [real_pair(url, 1000 * (threshold + 1) + 10 * i, long_queued) for i in range(ATTEMPTS)]
    with capsys.disabled():
        print(f"\nthreshold {threshold}, step {step_s * 1000:.1f} ms; first token long / short, "
              f"short queued: simulator {sim.long_done:.3f} / {sim.short_done:.3f} s, "
              f"{sim.short_queued / step_s:.0f} steps")  # fmt: skip
        for r in reals:
            print(f"  vLLM {r.long_done:.3f} / {r.short_done:.3f} s, "
                  f"{r.short_queued / step_s:.0f} steps")  # fmt: skip
    if waits:
        # Its first token not before the long prompt's last steps (which it shares: the
        # client may read either first), after sitting in the queue for most of the long
        # prefill (sent 60 ms into ~119 steps).
        assert sim.short_done > sim.long_done - 3 * step_s, sim
        assert sim.short_queued > 40 * step_s
        # The engine: an attempt tells something only if the short request reached the
        # engine inside the long prefill (it queued 20+ steps). The API server often hands
        # it over only after the long prompt's first token (0.3 s and more on this machine;
        # with 2-token steps, ~950, it never arrived inside): then there is nothing to see.
        inside = [r for r in reals if r.short_queued > 20 * step_s]
        if not inside:
            pytest.skip("no short request reached the engine inside the long prefill")
        assert all(r.short_done > r.long_done - 3 * step_s for r in inside), reals
    else:
        assert sim.order == expected
        assert sim.short_queued < 10 * step_s  # the next step (a loaded loop wakes late)
        # The engine: never queued behind the long prefill (20+ steps), whenever it came;
        # and, when it came inside the prefill, first.
        assert all(r.short_queued < 20 * step_s for r in reals), reals
        if not any(r.order == expected for r in reals):
            pytest.skip("no short request reached the engine inside the long prefill")
